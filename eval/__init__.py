"""`specheads eval` and `specheads profile`: how good a trained head is, and what it buys.

One head on one labelled dataset: the head and every training-free signal scored on the same held-out tokens (AUC,
calibration; `offline`), then decoding runs of every stop rule over held-out prompts, tuned on dev prompts and
reported on test prompts with paired intervals (`sweep`, resumable through `journal`, runs shared across heads by
`reuse`, thresholds taken from another report by `tuned`), optionally at serving batch sizes (`serving`) priced by
cost curves that `profile` measures or models. `run` checks every input before the first forward and writes the
report folder (metrics.json, plots, report.md/html; `report`, `plots`).
"""
