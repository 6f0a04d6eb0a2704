"""Acceptance heads (SpecDec++ ResNet head, its on-time and expected-acceptance variants, SPRINTER verifier, and the
linear confidence head engines run inside a DSpark drafter)."""

from specheads.heads.base import SIGNALS, STOP_PURPOSES, STORED_SIGNALS, TARGET_STALENESS, AcceptanceHead, with_derived_signals
from specheads.heads.calibration import PositionCalibration
from specheads.heads.dspark import DSparkConfidenceHead
from specheads.heads.linear import LinearVerifier
from specheads.heads.loading import DecisionRule, load_head
from specheads.heads.registry import HEADS, build_head, head_class
from specheads.heads.resnet import PRE_DRAW_SIGNALS, ExpectedAcceptanceHead, OnTimeAcceptanceHead, ResNetAcceptanceHead

__all__ = ["AcceptanceHead", "ResNetAcceptanceHead", "OnTimeAcceptanceHead", "ExpectedAcceptanceHead", "PRE_DRAW_SIGNALS",
           "STOP_PURPOSES", "PositionCalibration", "LinearVerifier", "DSparkConfidenceHead",
           "SIGNALS", "STORED_SIGNALS", "TARGET_STALENESS", "HEADS",
           "build_head", "head_class", "load_head", "DecisionRule", "with_derived_signals"]
