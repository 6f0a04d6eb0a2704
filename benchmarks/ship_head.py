"""Make the head that ships with specheads (`load_head("smollm2-ontime")`, heads/shipped/): the on-time head trained
on the embedded pair's 64x data, exported with its rule read from the costs and its weight matrices in float16.

    python benchmarks/ship_head.py --ckpt runs/train/ontime-64x/checkpoints/last.ckpt \\
        --report runs/offline/ontime-64x --out heads/shipped/smollm2-ontime

Data labelled before a safetensors file's fingerprint sorted the header's metadata keys (safetensors writes
them in a per-process hash order, so the embedded model converted on two machines hashed two ways). The export
records the identity the data recorded; this script replaces each such local model's `weights_sha256` by today's,
after checking that the recorded one is what the old whole-file hashing gives for the very files found here: the
same bytes, named the portable way. Any other difference is refused.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from specheads.pair.model_spec import ModelSpec  # noqa: E402
from specheads.pair.models import load_model, weights_identity, whole_file_weights_sha256  # noqa: E402
from specheads.plumbing.dataclass_cli import parse_script  # noqa: E402
from specheads.plumbing.files import write_json_atomic  # noqa: E402


@dataclass
class Config:
    """What to ship.

    Args:
        ckpt: the trained head's checkpoint.
        report: its eval report (calibration and metrics; the rule is read from it).
        out: the shipped head's folder.
    """

    ckpt: str
    report: str
    out: str = "heads/shipped/smollm2-ontime"


def portable(recorded: dict[str, Any]) -> dict[str, Any]:
    """`recorded` (a local model's `weights_identity`) with today's digest of the same files."""
    if not recorded or "weights_sha256" not in recorded:
        return recorded
    spec = ModelSpec(**recorded["spec"])
    today = weights_identity(spec, load_model(spec))
    if today == recorded:
        return recorded
    if {**today, "weights_sha256": None} != {**recorded, "weights_sha256": None}:
        raise SystemExit(f"ship_head.py: {spec.describe()} differs from what the data recorded in more than its digest")
    if whole_file_weights_sha256(spec) != recorded["weights_sha256"]:
        raise SystemExit(f"ship_head.py: the files of {spec.describe()} here are not the ones the data was labelled with")
    return today


def main() -> None:
    config = parse_script(Config, "ship_head.py", __doc__.splitlines()[0])
    from specheads.cli import main as specheads

    code = specheads(["export", "--ckpt", config.ckpt, "--report", config.report, "--out", config.out,
                      "--weights-dtype", "float16", "--overwrite", "true"])
    if code:
        raise SystemExit(code)
    path = Path(config.out) / "config.json"
    head = json.loads(path.read_text())
    identity = head["training_data"]["identity"]
    identity["target"] = head["target"]["weights"] = portable(identity["target"])
    if not identity["draft"].get("derived_from_target"):
        identity["draft"] = head["draft"]["weights"] = portable(identity["draft"])
    write_json_atomic(path, head)
    card = Path(config.out) / "README.md"
    card.write_text(card.read_text().replace(
        "\n## Limitations", "    python benchmarks/ship_head.py --ckpt " + config.ckpt + " --report " + config.report
        + "   # the model's digest named the portable way (the script's docstring)\n\n## Limitations", 1))
    print(f"shipped {config.out}: target weights {identity['target'].get('weights_sha256')}")


if __name__ == "__main__":
    main()
