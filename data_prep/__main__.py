"""`python -m data_prep --config FILE [key=value ...]`: prepare data.dir from data.source."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from summarizer.config.load import load_config, overridden
from summarizer.errors import UserError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m data_prep",
        description="Clean raw pairs, train SentencePiece and write memory-mappable token arrays to data.dir.")
    parser.add_argument("--config", metavar="FILE", help="YAML experiment config (defaults apply without one)")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="e.g. data.source=DIR data.dir=data/gw")
    parser.add_argument("--if-missing", action="store_true",
                        help="prepare only when data.dir holds no prepared data (what `make train` and `make eval` "
                             "run first). A prepared one is used as it is, with a note where its data settings or "
                             "inputs differ; a data.* key given here with another value than it holds is refused "
                             "(data.rebuild=true rebuilds it)")
    args = parser.parse_args(argv)
    try:
        from data_prep import prepare  # torch and datasets load here, inside the Ctrl-C handling
        from data_prep.pipeline import prepared_changes
        cfg = load_config(args.config, args.overrides).data
        if args.if_missing:
            given = {f"data.{key}" for key in overridden(args.overrides, "data")}
            try:
                changed = prepared_changes(Path(cfg.dir), cfg)
            except UserError:  # prepared, but its inputs cannot be listed (gone, or the dir copied elsewhere)
                if given & {"data.source", "data.root"}:
                    raise
                return 0  # the dir's own record stands, as it does for a data.source this command does not give
            if changed is None:
                source = (f"data.source={cfg.source!r}" if not isinstance(cfg.source, dict) else "the files "
                          "data.source lists" + (f" under data.root={cfg.root}" if cfg.root else ""))
                print(f"{cfg.dir} is not prepared yet: preparing it from {source} first", flush=True)
            elif not changed or not cfg.rebuild:
                refuse_or_note(cfg, changed, given)
                return 0
        prepare(cfg)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # nothing half-written counts as prepared: meta.json is written last
        print("interrupted; the next prep starts over (data.dir is not marked prepared until it completes)",
              file=sys.stderr)
        return 130
    return 0


def refuse_or_note(cfg, changed: list[str], given: set[str]) -> None:
    """What `make train`/`make eval` do with a data.dir prepared from other inputs or settings (`changed`): a data
    key this command gives (`given`: config.load.overridden's, as data.KEY) with another value than the dir holds is
    refused (DataError), as `make prep` refuses it, and so is a dir with a file missing; otherwise the dir is used as
    it is, with a note where its pieces, their cleaning, its inputs' contents or its prep version differ. What the
    dir was prepared from (data.source and its fields) is its own record there: `make eval ARGS="data.dir=data/gw"`
    evaluates on the dir prepared before, whatever the config's data.source says."""
    from data_prep.pipeline import refuse_silent_rebuild
    from summarizer.data.prepared import SHAPING_KEYS
    keyed = [(c, c.split(" ", 1)[0]) for c in changed]
    asked = [c for c, key in keyed if any(g == key or g.startswith(key + ".") for g in given)]
    if refused := asked + [c for c in changed if c.endswith(" is missing")]:
        refuse_silent_rebuild(Path(cfg.dir), refused)
    shaping = {f"data.{key}" for key in SHAPING_KEYS}
    other_source = any(key == "data.source" for _, key in keyed)  # then its files differ too: not news
    noted = [c for c, key in keyed if key in shaping or not (
        c.startswith(("data.", "its meta.json")) or other_source and c.endswith(" an input"))]
    if noted:
        print(f"note: {cfg.dir} was prepared with other data settings or inputs ({'; '.join(noted)}); it is used "
              f"as it is. To apply them, prepare into a new data.dir (or pass data.rebuild=true to replace this one: "
              f"runs trained on it could no longer resume)", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
