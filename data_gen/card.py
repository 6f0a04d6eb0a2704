"""The dataset card (README.md in the output folder): counts, mean acceptance, label semantics."""

from __future__ import annotations

from huggingface_hub import DatasetCard, DatasetCardData

from specheads.data_gen.drafter_labels import DEPTH_CHOICE
from specheads.model_outputs.states import describe_state

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
| `top2` | the second-largest q at i: with `top1`, the top-2 margin |
| `features` | the draft's hidden states, {state}, fp16 (bf16 as its uint16 bits with `features_dtype: bfloat16`), on prompt + `mixed_ids`: row 0 is the prompt's last position, row i the state that has read z_i; with `features_at` other than `all` only the rows it keeps (recomputed from `is_draft` by `specheads.dataset.storage.kept_rows`) |
"""
SIBLING_ROWS = ("| `sibling_ids` | a tree's second child: drawn from q without `draft_ids`' candidate (−1 where q "
                "has no other token) |\n"
                "| `sibling_accept` | its acceptance once the drafted candidate was rejected, min(1, p₂/q₂), p₂ = "
                "norm(max(0, p − q)), q₂ = q without the candidate (recursive rejection sampling) |\n"
                "| `sibling_beta` | the same known before it is drawn, Σ min(p₂, q₂) |\n"
                "| `sibling_logq` | log q(x₂) under the whole q (0 where there is no second child): the signal a head "
                "reads of a tree's child |\n")
DRAFTER_ROWS = ("| `depth` | the position's depth in its round (1 = the round's first candidate): the drafter drafted "
                "`draft_ids` there from the round's anchor `depth` positions back (see below) |\n"
                "| `features` (here) | the drafter's state after its final norm that produced q for position j + 1 (row j; "
                "row n: the one for position n + 1), computed on the prompt and the target's response |\n")
DRAFTER_SCORE_ROW = ("| `drafter_score` | the DSpark drafter's own confidence head: σ(proj([state ; Markov embedding])), its "
                     "prediction that the candidate is accepted, made before the candidate is drawn |\n")
MARKOV_ROW = ("| `markov_features` | markov_w1[the token before position j + 1] (row j, the rows `features` keeps): the "
              "Markov embedding DSpark's confidence head reads beside the state |\n")
TARGET_STATES_ROW = ("| `target_features` | the target's own states (after its final norm) on the same tokens and rows as `features`: "
                     "what the target computed at the positions it verified |\n")


def storage_line(manifest: dict) -> str:
    """Bytes per labelled token measured on the shard files, and which states were kept in which dtype."""
    storage, identity = manifest.get("storage"), manifest["identity"]
    if not storage:
        return "not measured (made before specheads recorded it)"
    line = f"{storage['bytes_per_labelled_token']:,.0f} bytes per labelled token ({storage['shard_bytes']:,} bytes of shards)"
    if not identity["store_features"]:
        return line
    return (f"{line}, of which {storage['state_bytes_per_labelled_token']:,.0f} hidden states: "
            f"{storage['states_kept']:,} of {storage['states_of_all_positions']:,} positions kept "
            f"(`features_at: {identity.get('features_at', 'all')}`), {identity.get('features_dtype', 'float16')}")


def drafter_rows(identity: dict) -> str:
    """The fields a feature drafter's data adds, and how its depths were chosen (nothing for a plain draft)."""
    drafter = identity["draft"]
    if "kind" not in drafter:
        return ""
    return (DRAFTER_ROWS + (DRAFTER_SCORE_ROW if drafter["scores"] else "") + (MARKOV_ROW if drafter["markov_rank"] else "")
            + "\n## Depth: chains of a feature drafter\n\n" + DEPTH_CHOICE.format(depth=drafter["depth"]) + "\n")


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
- on disk: {storage_line(manifest)}

| count | value |
|---|---|
| prompts labelled | {counts['prompts']} (left out as too long: {counts['skipped_prompts']}; without an imported response: {counts.get('unanswered_prompts', 0)}) |
| imported responses cut at max_new_tokens | {counts.get('truncated_responses', 0)} |
| imported responses cut at their first stop token | {counts.get('cut_at_stop_responses', 0)} |
| rows (prompt × sample) | {counts['rows']} |
| labelled tokens | {counts['labelled_tokens']} |
| draft tokens (`is_draft`) | {counts['draft_tokens']} |
| mean acceptance min(1, p/q) | {manifest['mean_accept']:.4f} |
| mean beta Σ min(p, q) | {manifest['mean_beta']:.4f} |

## Fields (one row per prompt × sample; per-position lists over the response)

{LABELS_TABLE.format(state=describe_state(identity.get('state_layer')))}{TARGET_STATES_ROW if identity.get('target_states') else ''}{SIBLING_ROWS if identity.get('sibling_labels') else ''}{drafter_rows(identity)}
Load it with `specheads.dataset.store.load_labelled(folder)` (memory-mapped `datasets.Dataset`).
"""
    return DatasetCard(f"---\n{data.to_yaml()}\n---\n{body}").content
