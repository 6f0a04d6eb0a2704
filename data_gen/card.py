"""The dataset card (README.md in the output folder): counts, mean acceptance, label semantics."""

from __future__ import annotations

from huggingface_hub import DatasetCard, DatasetCardData

from specheads.states import describe_state

LABELS_TABLE = """\
| field | meaning |
|---|---|
| `prompt_ids`, `target_ids` | the prompt (chat template applied) and the target's response y |
| `draft_ids` | candidate ŷ_i sampled from q(·∣x, y<i) at every response position |
| `mixed_ids`, `is_draft` | z_i = ŷ_i where `is_draft`, else y_i (token mixing, target kept with probability `target_ratio`) |
| `logp`, `logq` | log p(ŷ_i∣x, y<i), log q(ŷ_i∣x, y<i), both after the sampling transform |
| `accept` | min(1, p/q) of the candidate: SpecDec++'s soft label |
| `beta` | Σ_v min(p(v), q(v)): expected acceptance at i whatever is drafted |
| `entropy`, `top1` | H(q) and max q at i (at T = 0, of the untempered q) for the training-free baselines |
| `features` | draft last-layer hidden states (after the final norm), fp16, on prompt + `mixed_ids`: row 0 is the prompt's last position, row i the state that has read z_i |
"""


def dataset_card(manifest: dict) -> str:
    """Render the card for a finished run from its manifest."""
    counts = manifest["counts"]
    identity = manifest["identity"]
    sampling = identity["sampling"]
    data = DatasetCardData(
        tags=["speculative-decoding", "acceptance-prediction", "specheads"],
        size_categories=["n<1K"] if counts["rows"] < 1000 else ["1K<n<10K"] if counts["rows"] < 10000 else ["10K<n<100K"],
    )
    features = (f"{'stored' if identity['store_features'] else 'not stored (train online)'}; the draft state "
                f"{describe_state(identity.get('state_layer'))}")
    body = f"""
# Labelled token mixes for acceptance prediction

Made by `specheads gen` (version {manifest['tool_version']}) on {manifest.get('created', '?')}.
Fingerprint `{manifest['fingerprint']}`; `manifest.json` beside this card holds the full record.

- target: `{manifest['target_name']}`; draft: `{manifest['draft_name']}`
- sampling transform: temperature {sampling['temperature']}, top-k {sampling['top_k']}, top-p {sampling['top_p']}, at most {sampling['max_new_tokens']} new tokens
- token mixing: per-row target ratios {identity['mixing']['ratios']}
- hidden-state features: {features}

| count | value |
|---|---|
| prompts | {counts['prompts']} (skipped as too long: {counts['skipped_prompts']}) |
| rows (prompt × sample) | {counts['rows']} |
| labelled tokens | {counts['labelled_tokens']} |
| draft tokens (`is_draft`) | {counts['draft_tokens']} |
| mean acceptance min(1, p/q) | {manifest['mean_accept']:.4f} |
| mean beta Σ min(p, q) | {manifest['mean_beta']:.4f} |

## Fields (one row per prompt × sample; per-position lists over the response)

{LABELS_TABLE}
Load it with `specheads.data_gen.store.load_labelled(folder)` (memory-mapped `datasets.Dataset`).
"""
    return DatasetCard(f"---\n{data.to_yaml()}\n---\n{body}").content
