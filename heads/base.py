"""The base class every acceptance head shares: input checks, draft signals, save/load.

A head maps a draft hidden state (optionally with the candidate's input embedding and a few
standardised draft signals) to one acceptance logit per position. Its constructor arguments are its
config: `save_pretrained` writes them to `config.json` and the weights plus the signal statistics
to `model.safetensors`; `from_pretrained` rebuilds the head from both.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import math
import operator
from typing import Any, ClassVar

import torch
from huggingface_hub import PyTorchModelHubMixin
from torch import Tensor, nn

from specheads.heads.calibration import PositionCalibration
from specheads.heads.roles import ROLE_OF_PURPOSE, ROLES, roles_for
from specheads.plumbing.errors import UsageError

STORED_SIGNALS = ("logq", "entropy", "top1")
"""The draft signals `specheads gen` stores per position (and the training-free baselines are built from)."""

SIGNALS = (*STORED_SIGNALS, "q")
"""Draft signals a head may read: log q of the candidate, entropy H(q), the top-1 probability of q, and q of the
candidate itself. The data stores the first three; `q` = exp(logq) is derived (`with_derived_signals`) because
acceptance is not linear in log q: a linear probe of the first three ranks tokens below q(ŷ) alone."""


def with_derived_signals(columns: dict[str, Any]) -> dict[str, Any]:
    """`columns` (tensors or floats, holding `logq`) plus the derived signal `q` = exp(logq)."""
    logq = columns["logq"]
    return {**columns, "q": logq.exp() if isinstance(logq, torch.Tensor) else math.exp(logq)}

STOP_PURPOSES = ("stop", "expect")
"""The purposes of heads whose survival product Π â feeds a stop rule (and a verify budget)."""

TARGET_STALENESS = 6
"""A head reading the target's state is told how stale it is, k = 1..TARGET_STALENESS (one-hot; 0: fresh), k being
the candidate's position in its round: the target last verified the position k before the state that produced q."""

MIN_SIGNAL_STD = 1e-3
"""Floor on a signal's std: a signal constant in training still standardises to finite fp16 values."""


def check_count(name: str, value: Any, minimum: int) -> int:
    """`value` as a plain int >= `minimum`; a UsageError naming `name` otherwise."""
    try:
        count = operator.index(value)
    except TypeError:
        raise UsageError(f"{name} must be an integer >= {minimum}, got {value!r}") from None
    if count < minimum:
        raise UsageError(f"{name} must be an integer >= {minimum}, got {count}")
    return count


def check_signals(extra_features: list[str] | tuple[str, ...] | None) -> list[str]:
    """The requested draft signals as a list in the order given; unknown or repeated names are refused."""
    names = list(extra_features or [])
    unknown = [name for name in names if name not in SIGNALS]
    if unknown:
        raise UsageError(f"unknown extra feature(s) {', '.join(map(repr, unknown))}; known: {', '.join(SIGNALS)}")
    if len(set(names)) != len(names):
        raise UsageError(f"extra_features lists a signal twice: {names}; name each signal once")
    return names


def decision_timing(purpose: str, reads: str) -> str:
    """When a decoder has the score of candidate ŷ_k of a head of `purpose` reading `reads`: `before_draw` (from q_k's
    state and signals alone, before ŷ_k is drawn), `at_draft` (from the state that produced q for it and ŷ_k itself,
    the moment it is drafted) or `one_step_late` (from the state that has read it, after the next draft forward)."""
    if purpose == "expect":
        return "before_draw"
    return "one_step_late" if reads == "candidate_state" else "at_draft"


class AcceptanceHead(nn.Module, PyTorchModelHubMixin, library_name="specheads",
                     tags=["speculative-decoding", "acceptance-prediction"]):
    """A learned acceptance predictor: input features -> one logit per position.

    The input is concat[hidden, candidate embedding (when `candidate_embedding_size` > 0),
    standardised signals], the signals' columns in `extra_features` order. `state_dropout` drops
    dimensions of the standardised hidden state while training (a 576-wide state on tens of thousands of
    tokens overfits; the few signals are kept). `state_layer` says which draft state the head reads
    (`specheads.model_outputs.states`: None is the last layer after the final norm, L the residual stream after L layers). Subclasses set
    `head_type`, `reads` and `purpose`, implement `score`, and end in a linear layer `out` to one logit.
    A stop head may carry a `calibration` (heads.calibration) of its acceptance per position of a round.
    """

    head_type: ClassVar[str]
    reads: ClassVar[str]  # "candidate_state" (the state that has read the candidate) or "context_state" (the one before)
    # "stop": predicts min(1, p/q) of a drafted candidate for a stop rule; "expect": predicts α = Σ min(p, q) before
    # the candidate is drawn (a stop rule or a verify budget); "verify": SPRINTER's acceptable-or-not
    purpose: ClassVar[str]

    def __init__(self, hidden_size: int, extra_features: list[str] | None = None,
                 candidate_embedding_size: int = 0, state_dropout: float = 0.0, state_layer: int | None = None,
                 calibration: dict[str, Any] | None = None, target_state_size: int = 0) -> None:
        super().__init__()
        self.hidden_size = check_count("hidden_size", hidden_size, minimum=1)
        self.state_layer = None if state_layer is None else check_count("state_layer", state_layer, minimum=1)
        if not 0.0 <= state_dropout < 1.0:
            raise UsageError(f"state_dropout must be in [0, 1), got {state_dropout}; 0 turns it off")
        self.state_dropout = float(state_dropout)
        self.candidate_embedding_size = check_count("candidate_embedding_size", candidate_embedding_size, minimum=0)
        self.extra_features = check_signals(extra_features)
        self.target_state_size = check_count("target_state_size", target_state_size, minimum=0)
        if self.target_state_size:  # only then, so that heads saved before the option load strictly
            self.register_buffer("target_mean", torch.zeros(self.target_state_size))
            self.register_buffer("target_std", torch.ones(self.target_state_size))
        self.register_buffer("signal_mean", torch.zeros(len(self.extra_features)))
        self.register_buffer("signal_std", torch.ones(len(self.extra_features)))
        # a draft's last-layer states have a few outlier dimensions (|x| ~ 50 where most are ~ 1); standardising
        # them per dimension lets a few hundred Adam steps reach what a well-conditioned solver reaches
        self.register_buffer("hidden_mean", torch.zeros(self.hidden_size))
        self.register_buffer("hidden_std", torch.ones(self.hidden_size))
        # a head trained with class weights w_acc, w_rej predicts â = w_acc·a / (w_acc·a + w_rej·(1 − a)); adding
        # log(w_rej / w_acc) to its logit recovers a (the prior correction); `predict` applies it
        self.register_buffer("logit_correction", torch.zeros(()))
        self.calibration: PositionCalibration | None = None
        self.role = ROLE_OF_PURPOSE[self.purpose]  # trained on drafted candidates until `set_role` says otherwise
        self._record_config(hidden_size=self.hidden_size, extra_features=list(self.extra_features),
                            state_dropout=self.state_dropout, state_layer=self.state_layer,
                            head_type=self.head_type, reads=self.reads, decides=self.decides, purpose=self.purpose,
                            role=self.role)
        self.set_calibration(None if calibration is None else PositionCalibration.from_dict(calibration))

    @property
    def decides(self) -> str:
        """When a decoder has the head's score of candidate ŷ_k (`decision_timing`)."""
        return decision_timing(self.purpose, self.reads)

    def set_role(self, role: str) -> None:
        """Record what the head was trained on (`specheads.heads.roles`: `chain_stop`, `expected_acceptance`, `sibling`,
        `verifier`), which decides where a decoder may use it; a role this class cannot have is refused."""
        allowed = roles_for(self.purpose, self.reads)
        if role not in allowed:
            known = f"known roles: {', '.join(ROLES)}" if role not in ROLES else f"a {self.head_type} head can be {', '.join(allowed)}"
            raise UsageError(f"role {role!r} does not fit this {self.head_type} head ({known}); record the role it was "
                             "trained for")
        self.role = role
        self._record_config(role=role)

    def set_calibration(self, calibration: PositionCalibration | None) -> None:
        """Use (and record in the config) a per-position calibration of the acceptance; None removes it."""
        if calibration is not None and self.purpose not in STOP_PURPOSES:
            raise UsageError(f"a {self.head_type} head feeds no stop rule, so its cumulative acceptance has nothing to "
                             "calibrate; calibrate a stop head (specdecpp_ontime, specdecpp_resnet)")
        self.calibration = calibration
        if self.purpose in STOP_PURPOSES:
            self._record_config(calibration=None if calibration is None else calibration.as_dict())

    def _record_config(self, **values: Any) -> None:
        """Store normalised constructor values in the config `save_pretrained` writes.

        The mixin captures the raw arguments before `__init__` runs: it silently drops values that are
        not plain JSON (a numpy int hidden_size would vanish) and keeps `None` and tuples as given.
        """
        self._hub_mixin_config = {**(self._hub_mixin_config or {}), **values}

    @property
    def config(self) -> dict[str, Any]:
        """A copy of what `config.json` will hold; merge into it when passing `config=` to save_pretrained."""
        return dict(self._hub_mixin_config or {})

    @property
    def input_size(self) -> int:
        """Width of the concatenated input the head scores."""
        target = self.target_state_size + TARGET_STALENESS + 1 if self.target_state_size else 0
        return self.hidden_size + self.candidate_embedding_size + target + len(self.extra_features)

    def num_parameters(self) -> int:
        """Number of trainable scalars (the signal statistics are buffers and not counted)."""
        return sum(p.numel() for p in self.parameters())

    def weights_digest(self) -> str:
        """A short hash of every weight and statistics buffer and of the per-position calibration: equal exactly when
        two heads score alike."""
        digest = hashlib.sha256()
        for name, tensor in sorted(self.state_dict().items()):
            digest.update(name.encode())
            digest.update(tensor.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
        if self.calibration is not None:  # kept apart so that an uncalibrated head's digest is what it always was
            digest.update(json.dumps(self.calibration.as_dict(), sort_keys=True).encode())
        return digest.hexdigest()[:16]

    def set_signal_statistics(self, mean: Tensor, std: Tensor) -> None:
        """Set the signals' standardisation from the training split; std is floored at MIN_SIGNAL_STD."""
        self._set_statistics("signal", mean, std, len(self.extra_features), f"one per extra feature {self.extra_features}")

    def standardised_signals(self, signals: Tensor) -> Tensor:
        """The draft signals [..., len(extra_features)] as the head reads them (training-split mean/std)."""
        return (signals - self.signal_mean) / self.signal_std

    @torch.no_grad()
    def start_at_signal_probe(self, coefficients: Tensor, intercept: float) -> None:
        """Set the output layer to a linear probe of the standardised signals alone (zero weight on every other
        input): with the zero-initialised blocks the untrained head is then exactly that probe."""
        signals = len(self.extra_features)
        if coefficients.shape != (signals,):
            raise UsageError(f"a signal probe needs one coefficient per extra feature {self.extra_features}, "
                             f"got shape {list(coefficients.shape)}")
        self.out.weight.zero_()
        if signals:
            self.out.weight[0, -signals:] = coefficients.to(self.out.weight)
        self.out.bias.fill_(intercept)

    def set_hidden_statistics(self, mean: Tensor, std: Tensor) -> None:
        """Set the hidden state's per-dimension standardisation from the training split (std floored)."""
        self._set_statistics("hidden", mean, std, self.hidden_size, "one per hidden dimension")

    def set_target_statistics(self, mean: Tensor, std: Tensor) -> None:
        """Set the target state's per-dimension standardisation from the training split (std floored)."""
        self._set_statistics("target", mean, std, self.target_state_size, "one per target hidden dimension")

    def _set_statistics(self, kind: str, mean: Tensor, std: Tensor, size: int, why: str) -> None:
        for name, value in (("mean", mean), ("std", std)):
            if tuple(value.shape) != (size,):
                raise UsageError(f"{kind} {name} must have shape [{size}] ({why}), got {list(value.shape)}")
            if not torch.isfinite(value).all():
                raise UsageError(f"{kind} {name} holds non-finite values; compute it on finite inputs")
        with torch.no_grad():
            getattr(self, f"{kind}_mean").copy_(mean)
            getattr(self, f"{kind}_std").copy_(std.clamp_min(MIN_SIGNAL_STD))

    def score(self, features: Tensor) -> Tensor:
        """Logits [...] from input features [..., input_size]; implemented by each head."""
        raise NotImplementedError

    def forward(self, hidden: Tensor, signals: Tensor | None = None, candidate_embedding: Tensor | None = None,
                target_state: Tensor | None = None, staleness: Tensor | None = None) -> Tensor:
        """Acceptance logits with the leading dims of `hidden` ([..., hidden_size] -> [...]); a head with
        `target_state_size` also reads the target's state at the last verified position and its `staleness` k."""
        return self.score(self.features(hidden, signals, candidate_embedding, target_state, staleness))

    @torch.no_grad()
    def predict(self, hidden: Tensor, signals: Tensor | None = None, candidate_embedding: Tensor | None = None,
                position: Tensor | int | None = None, **inputs: Tensor) -> Tensor:
        """Acceptance probabilities without gradients: sigmoid of the logits plus the class-weight correction, and
        through the head's per-position calibration when `position` (1-based within the round) is given; `inputs`
        go to `forward` (a DSpark head's `markov_embedding`)."""
        return self.probabilities(self(hidden, signals, candidate_embedding, **inputs), position)

    def probabilities(self, logits: Tensor, position: Tensor | int | None = None) -> Tensor:
        """Probabilities from `forward`'s logits: sigmoid(logits + log(w_rej / w_acc)), calibrated for the candidates'
        `position` in the round when the head carries a calibration and a position is given."""
        corrected = logits + self.logit_correction
        if position is not None and self.calibration is not None:
            corrected = self.calibration.logits(corrected, torch.as_tensor(position).expand(corrected.shape))
        return torch.sigmoid(corrected)

    def set_class_weights(self, w_acc: float, w_rej: float) -> None:
        """Record the training loss's class weights, so that `predict` undoes their shift of the probabilities."""
        with torch.no_grad():
            self.logit_correction.fill_(math.log(w_rej / w_acc))

    def features(self, hidden: Tensor, signals: Tensor | None = None, candidate_embedding: Tensor | None = None,
                 target_state: Tensor | None = None, staleness: Tensor | None = None) -> Tensor:
        """The checked, concatenated input [..., input_size], in the head's parameter dtype."""
        dtype = next(self.parameters()).dtype
        hidden = self._checked("hidden", hidden, hidden, self.hidden_size, "the head's hidden_size")
        # dropout on the standardised state sets dimensions to their training mean; the signals are never dropped
        state = (hidden.to(dtype) - self.hidden_mean) / self.hidden_std
        parts = [nn.functional.dropout(state, self.state_dropout, self.training)]
        if self.candidate_embedding_size:
            if candidate_embedding is None:
                raise UsageError(f"this {self.head_type} head reads the candidate's input embedding "
                                 f"(candidate_embedding_size={self.candidate_embedding_size}); pass candidate_embedding")
            parts.append(self._checked("candidate_embedding", candidate_embedding, hidden,
                                       self.candidate_embedding_size, "the head's candidate_embedding_size"))
        elif candidate_embedding is not None:
            raise UsageError(f"this {self.head_type} head reads no candidate embedding "
                             "(candidate_embedding_size=0); pass candidate_embedding=None")
        if self.target_state_size:
            if target_state is None or staleness is None:
                raise UsageError(f"this {self.head_type} head reads the target's state at the last verified position "
                                 f"(target_state_size={self.target_state_size}); pass target_state and staleness")
            target = self._checked("target_state", target_state, hidden, self.target_state_size,
                                   "the head's target_state_size")
            parts.append(nn.functional.dropout((target.to(dtype) - self.target_mean) / self.target_std,
                                               self.state_dropout, self.training))
            parts.append(nn.functional.one_hot(staleness.long().clamp(0, TARGET_STALENESS), TARGET_STALENESS + 1))
        elif target_state is not None:
            raise UsageError(f"this {self.head_type} head reads no target state (target_state_size=0); pass "
                             "target_state=None")
        if self.extra_features:
            if signals is None:
                raise UsageError(f"this head reads the draft signals {self.extra_features}; pass signals "
                                 f"[..., {len(self.extra_features)}] in that order")
            signals = self._checked("signals", signals, hidden, len(self.extra_features),
                                    f"one column per extra feature {self.extra_features}")
            parts.append(self.standardised_signals(signals.to(dtype)))
        elif signals is not None and signals.shape[-1] != 0:
            raise UsageError(f"this head reads no draft signals (extra_features=[]) but got signals of shape "
                             f"{list(signals.shape)}; pass signals=None")
        return torch.cat([part.to(dtype) for part in parts], dim=-1)

    @staticmethod
    def _checked(name: str, tensor: Tensor, hidden: Tensor, width: int, why: str) -> Tensor:
        """`tensor` if it is [*hidden.shape[:-1], width]; a UsageError naming expected vs got otherwise."""
        expected = [*hidden.shape[:-1], width]
        if list(tensor.shape) != expected:
            raise UsageError(f"{name} must have shape {expected} (last dim = {why}), got {list(tensor.shape)}")
        return tensor

    @classmethod
    def _from_pretrained(cls, *, model_id: str, config: dict | None = None, strict: bool = True,
                         **kwargs: Any) -> AcceptanceHead:
        """Load with strict key matching (the mixin's default is lenient) and refuse another head type's folder."""
        saved_type = (config or {}).get("head_type", cls.head_type)
        if saved_type != cls.head_type:
            raise UsageError(f"{model_id} holds a {saved_type!r} head, not {cls.head_type!r}; "
                             "load it with the class registered for that type (heads.head_class)")
        with contextlib.redirect_stdout(io.StringIO()):  # the mixin prints a line on every local load
            return super()._from_pretrained(model_id=model_id, strict=strict, **kwargs)
