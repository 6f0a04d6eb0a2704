"""Acceptance heads (SpecDec++ ResNet head, SPRINTER linear verifier): modules, registry, save/load."""

from specheads.heads.base import SIGNALS, STORED_SIGNALS, AcceptanceHead, with_derived_signals
from specheads.heads.linear import LinearVerifier
from specheads.heads.loading import DecisionRule, load_head
from specheads.heads.registry import HEADS, build_head, head_class
from specheads.heads.resnet import ResNetAcceptanceHead

__all__ = ["AcceptanceHead", "ResNetAcceptanceHead", "LinearVerifier", "SIGNALS", "STORED_SIGNALS", "HEADS",
           "build_head", "head_class", "load_head", "DecisionRule", "with_derived_signals"]
