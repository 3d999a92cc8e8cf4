"""The research harness: tools over finished run dirs, for comparing against this baseline (docs/comparing.md).
Imported only by the CLI (`python -m summarizer compare|average|seeds|report`); the core never imports it.

    compare.py   two systems' predictions on the same references: B-A, paired bootstrap and randomization p-values
    average.py   the element-wise mean of a run's last N step checkpoints
    seeds.py     train + evaluate one config over seeds 1..N, mean ± std of ROUGE
    report.py    a Markdown or CSV table of runs: config diff, steps, precision, commit, ROUGE
"""
