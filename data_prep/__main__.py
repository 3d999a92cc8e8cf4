"""`python -m data_prep --config FILE [key=value ...]`: prepare data.dir from data.source."""
from __future__ import annotations

import argparse
import sys

from data_prep import prepare
from summarizer.config import load_config
from summarizer.errors import UserError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m data_prep",
        description="Clean raw pairs, train SentencePiece and write memory-mappable token arrays to data.dir.")
    parser.add_argument("--config", metavar="FILE", help="YAML experiment config (defaults apply without one)")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="e.g. data.source=DIR data.dir=data/gw")
    args = parser.parse_args(argv)
    try:
        prepare(load_config(args.config, args.overrides).data)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # nothing half-written counts as prepared: meta.json is written last
        print("interrupted; the next prep starts over (data.dir is not marked prepared until it completes)",
              file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
