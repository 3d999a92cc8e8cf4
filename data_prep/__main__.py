"""`python -m data_prep --config FILE [key=value ...]`: prepare data.dir from data.source."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from summarizer.config.load import load_config
from summarizer.errors import UserError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m data_prep",
        description="Clean raw pairs, train SentencePiece and write memory-mappable token arrays to data.dir.")
    parser.add_argument("--config", metavar="FILE", help="YAML experiment config (defaults apply without one)")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="e.g. data.source=DIR data.dir=data/gw")
    parser.add_argument("--if-missing", action="store_true",
                        help="prepare only when data.dir holds no prepared data (what `make train` and `make eval` "
                             "run first); one prepared from these inputs and data settings is used as it is, one "
                             "prepared from others is refused naming what differs (data.rebuild=true rebuilds it)")
    args = parser.parse_args(argv)
    try:
        from data_prep import prepare  # torch and datasets load here, inside the Ctrl-C handling
        from data_prep.pipeline import prepared_changes
        cfg = load_config(args.config, args.overrides).data
        if args.if_missing:
            changed = prepared_changes(Path(cfg.dir), cfg)
            if changed == []:
                return 0
            if changed is None:
                source = (f"data.source={cfg.source!r}" if not isinstance(cfg.source, dict) else "the files "
                          "data.source lists" + (f" under data.root={cfg.root}" if cfg.root else ""))
                print(f"{cfg.dir} is not prepared yet: preparing it from {source} first", flush=True)
        prepare(cfg)
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
