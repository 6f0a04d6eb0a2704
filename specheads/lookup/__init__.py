"""Free drafts read from the context (prompt lookup, suffix trees) and what is known about their proposals.

A light package: its modules import only the standard library, numpy, torch, safetensors and (lazily)
arctic_inference, never transformers nor another specheads module, so vLLM's environment can import it.
`proposers` makes the proposals (`ngram_propose`, `SuffixProposer`).
"""
