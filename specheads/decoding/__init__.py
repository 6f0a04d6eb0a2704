"""The decoding core: one round engine over B rows, the rules it runs, the caches and the exact sampler.

`RoundEngine(target, draft, transform, stop_ids).decode(prompts, rule, max_new_tokens, seeds, head)` runs any rule
of `specheads.decoding.rules.RULES` (`make_policy(name, threshold, max_draft)`); eval's sweep, its serving table and
the integrations use it. A new rule is one class, registered where it is defined: `rules.py` (rules without state),
`online.py` (rules that adapt at run time), `cost_rule.py`, `planners.py` (batch-level rules), `calibration.py`
(rules on estimates refitted while serving), `free_rules.py` (the rules of free drafts, `free_draft.LookupDraft`:
prompt lookup and suffix drafts); importing this package imports each of them, so the registry is whole.
`PromptCache` keeps prompts' keys and values from one decode to the next (eval decodes the same prompts under every
setting).
"""

from specheads.decoding import calibration, cost_rule, free_rules, online, planners  # noqa: F401  (each registers its rules in RULES)
from specheads.decoding.cache import BatchCache
from specheads.decoding.engine import RoundEngine, acceptance_batch, candidate_signals
from specheads.decoding.prompt_cache import PromptCache
from specheads.decoding.result import DecodeResult
from specheads.decoding.rules import RULES, STOP_POLICIES, Drafted, SprinterRule, StopPolicy, make_policy

__all__ = ["RULES", "STOP_POLICIES", "BatchCache", "DecodeResult", "Drafted", "PromptCache", "RoundEngine", "SprinterRule", "StopPolicy",
           "acceptance_batch", "candidate_signals", "make_policy"]
