"""Acceptance heads (SpecDec++ ResNet head and its on-time variant, SPRINTER linear verifier): modules, registry, save/load."""

from specheads.heads.base import SIGNALS, STORED_SIGNALS, AcceptanceHead, with_derived_signals
from specheads.heads.calibration import PositionCalibration
from specheads.heads.linear import LinearVerifier
from specheads.heads.loading import DecisionRule, load_head
from specheads.heads.registry import HEADS, build_head, head_class
from specheads.heads.resnet import OnTimeAcceptanceHead, ResNetAcceptanceHead

__all__ = ["AcceptanceHead", "ResNetAcceptanceHead", "OnTimeAcceptanceHead", "PositionCalibration", "LinearVerifier",
           "SIGNALS", "STORED_SIGNALS", "HEADS",
           "build_head", "head_class", "load_head", "DecisionRule", "with_derived_signals"]
