"""Command line: `python -m summarizer {train,eval,summarize,bench,overfit} --config FILE [key=value ...]`, and the
research harness `python -m summarizer {compare,average,seeds,report} ...`."""
from __future__ import annotations

import argparse
import errno
import importlib
import json
import os
import signal
import sys

from summarizer.config.load import load_config, load_stages, overridden
from summarizer.errors import Stopped, UserError

COMMANDS = {
    "train": "train a run; resumes from the run's latest checkpoint",
    "eval": "decode a split and write predictions + ROUGE report",
    "summarize": "summarize text from stdin, one input per line",
    "bench": "measure what each training practice buys on this machine",
    "overfit": "train on a few pairs and fail unless the model memorises them",
}
# The research harness: each module adds its own options (`add_arguments`) and runs its command (`cli`).
HARNESS = {
    "compare": ("summarizer.harness.compare",
                "ROUGE of two systems' predictions, B-A, bootstrap and randomization p-values"),
    "average": ("summarizer.harness.average", "average the weights of a run's last N step checkpoints"),
    "seeds": ("summarizer.harness.seeds", "train and evaluate a config with seeds 1..N; mean and std of ROUGE"),
    "report": ("summarizer.harness.report", "a Markdown (or CSV) table of runs: config diff, steps, precision, ROUGE"),
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m summarizer", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, text in COMMANDS.items():
        cmd = sub.add_parser(name, help=text, description=text)
        cmd.add_argument("--config", help="YAML experiment file (see configs/)")
        cmd.add_argument("overrides", nargs="*", metavar="key.sub=value", help="config overrides, applied in order")
    for name, (module, text) in HARNESS.items():
        importlib.import_module(module).add_arguments(sub.add_parser(name, help=text, description=text))
    return parser.parse_args(argv)


def run(args: argparse.Namespace) -> int:
    if args.command in HARNESS:
        return importlib.import_module(HARNESS[args.command][0]).cli(args)
    if args.command == "train":
        from summarizer.train.stages import train_stages
        stages = load_stages(args.config, args.overrides)
        summary = train_stages(stages)
        if summary is None:
            from summarizer.model import checkpoint
            run_dir = stages[-1][1].run_dir
            scores = "`make eval` scores best.pt" if (run_dir / checkpoint.BEST).is_file() else (
                f"it holds no best.pt (no validation ran); eval.checkpoint={checkpoint.latest_path(run_dir)} "
                f"scores its last weights")
            print(f"{'every stage of the recipe is' if len(stages) > 1 else 'the run is'} finished: nothing to "
                  f"train; {scores}")
            return 0
        best = summary["best"]
        best = "n/a" if best is None else f"{best['metric']} {best['value']:.4g}"
        print(f"trained {summary['steps']} steps in {summary['minutes']:.1f} min; best valid {best}; "
              f"checkpoints in {summary['run_dir']}")
        if summary["signal"] is None:
            return 0
        name = signal.Signals(summary["signal"]).name
        if summary["finished"]:  # the signal came after the run's last validation
            print(f"finished at step {summary['steps']} ({name} came after its last validation)", file=sys.stderr)
            if not summary["stages_left"]:
                return 0
            print(f"{name} came before the recipe's next stage: run the same command again to train the "
                  f"{summary['stages_left']} stage(s) left", file=sys.stderr)
            return 128 + summary["signal"]  # not done: a scheduler that requeues on a stop must requeue
        owed = " before its validation" if summary["owes_validation"] else ""
        print(f"stopped by {name} at step {summary['steps']}{owed}, after writing its checkpoint; run the same "
              f"command again to resume{' (the validation first)' if owed else ''}", file=sys.stderr)
        return 128 + summary["signal"]  # as shells expect, so a scheduler records a stop, not a failure
    cfg = load_config(args.config, args.overrides)
    if args.command in ("eval", "summarize") and (given := overridden(args.overrides, "data")):
        # the prepared dir's normalisation and vocabulary (meta.json) apply, whatever the config file says; one its
        # command line contradicts is refused, as train and `make eval` (data_prep --if-missing) refuse it
        from summarizer.data.prepared import check_data_settings, read_meta
        check_data_settings(cfg.data, read_meta(cfg.data.dir), given)
    if args.command == "overfit":
        from summarizer.overfit import overfit_check
        return overfit_check(cfg)
    if args.command == "eval":
        from summarizer.evaluation.evaluate import evaluate
        report = evaluate(cfg)
        print(json.dumps({k: report[k] for k in ("rouge1", "rouge2", "rougeL") if k in report}))
        return 0
    if args.command == "summarize":
        from summarizer.summarize import summarize_stream
        if sys.stdin is None:
            raise UserError("summarize reads text from standard input, which is closed: pipe or redirect the text "
                            "in, one input per line (e.g. `summarize ... < articles.txt`)")
        if sys.stdout is None:
            raise UserError("summarize writes its summaries to standard output, which is closed: redirect it to a "
                            "file or a pipe (e.g. `summarize ... > headlines.txt`)")
        summarize_stream(cfg, sys.stdin.buffer, sys.stdout)
        return 0
    from summarizer.bench.run import run_bench
    run_bench(cfg)
    return 0


def main(argv: list[str] | None = None) -> int:
    try:
        return run(parse_args(argv))  # parsing imports the harness, and torch with it: Ctrl-C is handled from here
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:  # a second stop signal (Stopped), or Ctrl-C outside training
        signum = getattr(exc, "signum", signal.SIGINT)
        print(f"stopped by a second {signal.Signals(signum).name}: exiting at once; checkpoints already written "
              f"are intact" if isinstance(exc, Stopped) else "interrupted", file=sys.stderr)
        return 128 + signum
    except BrokenPipeError:  # the reader went away (`summarize ... | head -1`): stop quietly, as Unix tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error when Python flushes
        return 1
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT):
            raise
        print(f"error: {exc.filename or 'a file'}: {exc.strerror}: free disk space (or lift the file-size limit) "
              f"and run the same command again; files written before this one, checkpoints included, are intact",
              file=sys.stderr)
        return 1
    finally:
        if "torch" in sys.modules:  # leave the process group and stop leftover workers, whatever happened
            from summarizer.runtime import teardown
            teardown()


if __name__ == "__main__":
    sys.exit(main())
