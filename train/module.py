"""`AcceptanceModule`: trains one head (SpecDec++ ResNet or SPRINTER verifier) with the weighted BCE.

The head is built from the registry by name; its hidden size comes from the dataset's manifest
unless the config names one (then a mismatch is refused). Validation each epoch logs the weighted
loss, binary KL, AUC and ECE of the head and, on the same tokens, the AUC of the training-free
signals and the binary KL of the constant predictor, so the head's margin is visible as it trains.
"""

from __future__ import annotations

import inspect
import math
from pathlib import Path
from typing import Any, Literal

import lightning as L
import numpy as np
import torch
from torchmetrics.aggregation import CatMetric
from transformers import get_cosine_schedule_with_warmup

from specheads.artifacts.checkpoint import head_from_hyperparameters
from specheads.artifacts.metrics import baseline_scores, binary_kl, expected_calibration_error, soft_auc
from specheads.dataset.targets import (
    CONTEXT_STATE,
    Contexts,
    draft_features,
    head_inputs,
    markov_argument,
    stale_target_states,
    token_targets,
)
from specheads.heads import SIGNALS, STOP_PURPOSES, STORED_SIGNALS, TARGET_STALENESS, AcceptanceHead, head_class
from specheads.heads.calibration_fit import fit_position_calibration, fit_sibling_calibration
from specheads.heads.roles import role_of
from specheads.model_outputs.states import describe_state
from specheads.plumbing.errors import UsageError
from specheads.train.loss import position_weights, run_positions, weighted_bce
from specheads.train.probe import signal_probe

VALIDATION_COLUMNS = ("prediction", "label", *STORED_SIGNALS)


class AcceptanceModule(L.LightningModule):
    """One acceptance head and its training objective.

    Args:
        head: registry name: `specdecpp_resnet`, `specdecpp_ontime`, `expected_acceptance` or `sprinter_linear`.
        head_args: further constructor arguments of the head (e.g. `{depth: 3}`).
        extra_features: draft signals to concatenate to the state, from `heads.SIGNALS` (logq, entropy, top1, q).
        candidate_embedding: feed the candidate's input embedding (from the draft) to a verifier.
        hidden_size: expected draft hidden size; null takes the dataset's, a different value is refused.
        draft: expected draft name (as `specheads gen` recorded it); null accepts the dataset's.
        w_acc, w_rej: weights of the accepted and rejected terms of the BCE (SpecDec++: 1 and 6).
        tau: SPRINTER's ratio threshold: label 1[q/p ≤ τ] (1, 1.2, 1.5 in the paper).
        contexts: SPRINTER positions: `consistent` (prefix all target tokens) or `all`.
        optimizer, lr, weight_decay, warmup_ratio: AdamW/Adam with linear warmup then cosine decay.
        ece_bins: bins of the expected calibration error.
        embedding_size: filled in from the draft when `candidate_embedding` is on; leave it at 0.
        start_from_signals: start the output layer at the weighted logistic regression of the extra features
            on the training labels (`train.probe`), so that the untrained head already uses the draft's signals.
        calibrate_positions: a stop head's calibration of Π â per round position k = 1..this (`heads.calibration_fit`),
            fitted after every validation on the data's calibration prompts (`data.calibration_fraction`) and
            stored with the weights; 0 fits none.
        target_state: a head deciding at draft also reads the target's state at the last position it verified and
            how stale it is (data from `specheads gen --target_states true`; `targets.stale_target_states`).
        position_gamma: weigh each token's loss by DSpark's w_k = exp(−(k − 1)/γ), k its position in its run of
            drafted tokens (`train.loss.run_positions`); null weighs every position alike.
        alpha_weight: weight of an auxiliary BCE of a second output (on the head's last representation) against the
            analytic α = Σ min(p, q) at the same tokens; the auxiliary output is dropped when the head is saved.
    """

    def __init__(self, head: str = "specdecpp_resnet", head_args: dict[str, Any] | None = None,
                 extra_features: list[str] | None = None, candidate_embedding: bool = False,
                 hidden_size: int | None = None, draft: str | None = None, w_acc: float = 1.0, w_rej: float = 6.0,
                 tau: float = 1.0, contexts: Contexts = "consistent", optimizer: Literal["adamw", "adam"] = "adamw",
                 lr: float = 1e-3, weight_decay: float = 0.0, warmup_ratio: float = 0.05, ece_bins: int = 10,
                 embedding_size: int = 0, start_from_signals: bool = True, calibrate_positions: int = 0,
                 target_state: bool = False, position_gamma: float | None = None, alpha_weight: float = 0.0):
        super().__init__()
        if calibrate_positions and head_class(head).purpose not in STOP_PURPOSES:
            raise UsageError(f"model.calibrate_positions calibrates a stop head's cumulative acceptance; a {head} head "
                             "has none: set it to 0")
        if calibrate_positions < 0:
            raise UsageError(f"model.calibrate_positions must be >= 0, got {calibrate_positions}")
        if target_state and head != "specdecpp_ontime":
            raise UsageError(f"model.target_state feeds the target's last verified state to a head that decides at "
                             f"draft (specdecpp_ontime); a {head} head cannot read it: set it false")
        if position_gamma is not None and position_gamma <= 0:
            raise UsageError(f"model.position_gamma must be positive (or null for no position weights), got {position_gamma}")
        if alpha_weight < 0 or (alpha_weight and head_class(head).purpose != "stop"):
            raise UsageError(f"model.alpha_weight ({alpha_weight}) weighs an auxiliary α target of a stop head; give a "
                             "value >= 0 with a stop head (specdecpp_ontime, specdecpp_resnet), or 0")
        if tau <= 0 or w_acc <= 0 or w_rej <= 0:
            raise UsageError(f"model.tau, model.w_acc and model.w_rej must be positive, got {tau}, {w_acc}, {w_rej}")
        self.save_hyperparameters()
        self.head: AcceptanceHead | None = None
        self.signal_index = [SIGNALS.index(name) for name in (extra_features or [])]
        self.draft_model: list[torch.nn.Module] = []  # a list keeps the frozen draft out of the state dict
        self.embeddings: torch.nn.Embedding | None = None
        self.alpha_out: torch.nn.Linear | None = None
        self.validation = torch.nn.ModuleDict({name: CatMetric(nan_strategy="disable") for name in VALIDATION_COLUMNS})
        self.constant = float("nan")
        if hidden_size is not None and (head_args or {}).get("markov_rank", 0) is not None:  # null: the data's, in setup
            self.build(hidden_size, embedding_size)

    @property
    def reads(self) -> str:
        """Which hidden state the head reads."""
        return head_class(self.hparams.head).reads

    @property
    def purpose(self) -> str:
        """What the head learns: `stop` (min(1, p/q) for a stop rule), `expect` (α = Σ min(p, q) before the draw) or
        `verify` (SPRINTER's label)."""
        return head_class(self.hparams.head).purpose

    def build(self, hidden_size: int, embedding_size: int) -> None:
        """Create the head (once the hidden size and embedding size are known), and the auxiliary α output."""
        self.head = head_from_hyperparameters({**self.hparams, "hidden_size": hidden_size, "embedding_size": embedding_size})
        self.hparams.embedding_size = embedding_size
        if self.hparams.alpha_weight:
            self.alpha_out = torch.nn.Linear(self.head.input_size, 1)

    # ---- setup: match the data, load what online training and embeddings need, signal statistics

    def setup(self, stage: str) -> None:
        data = self.trainer.datamodule
        data.setup(stage)
        expected, found = self.hparams.hidden_size, data.hidden_size
        if expected is not None and expected != found:
            raise UsageError(f"the head expects hidden size {expected} but {data.path} was labelled with a draft of hidden "
                             f"size {found} ({data.draft_name}); set model.hidden_size to {found} or null, or use matching data")
        if self.hparams.draft is not None and self.hparams.draft != data.draft_name:
            raise UsageError(f"the config names draft {self.hparams.draft!r} but {data.path} was labelled with draft "
                             f"{data.draft_name!r}; fix model.draft or use data from that draft")
        self.match_state_layer(data)
        self.match_target_states(data)
        self.match_markov(data)
        data.require_states(self.hparams.head, self.reads, self.purpose)
        if data.children == "second" and (self.purpose not in STOP_PURPOSES or self.reads != CONTEXT_STATE):
            raise UsageError(f"data.children: second trains a head of a tree's later siblings, which a tree scores from "
                             f"the parent's state before the sibling is read; a {self.hparams.head} head ({self.purpose}, "
                             f"reads {self.reads}) cannot: use specdecpp_ontime or expected_acceptance")
        self.hparams.hidden_size = found
        self.hparams.draft = data.draft_name
        self.hparams.data_fingerprint = data.fingerprint
        self.hparams.data_sampling = data.manifest["identity"]["sampling"]
        self.hparams.data_identity = data.manifest["identity"]
        self.hparams.target = data.manifest.get("target_name")
        # the prompts it trains on travel with the head: eval holds out every other prompt, whatever data it reads
        # (every prompt of the training split, also those a `data.train_rows` subset leaves out)
        self.hparams.data_split = {"val_fraction": data.val_fraction, "split_seed": data.split_seed,
                                   "train_prompts": data.training_prompts,
                                   **({"train_rows": data.train_rows} if data.train_rows is not None else {}),
                                   **({"children": data.children} if data.children != "first" else {})}
        if self.hparams.calibrate_positions:
            if "calibration" not in data.splits:
                raise UsageError(f"model.calibrate_positions is {self.hparams.calibrate_positions} but the data holds no "
                                 "calibration prompts; set data.calibration_fraction (e.g. 0.1)")
            self.hparams.data_split.update(calibration_fraction=data.calibration_fraction,
                                           calibration_prompts=data.prompt_digests("calibration"))
        if data.mode == "online" or self.hparams.candidate_embedding:
            from specheads.train.draft import load_draft

            draft = load_draft(data.manifest)
            if data.mode == "online":
                self.draft_model = [draft.to(self.trainer.strategy.root_device)]
            if self.hparams.candidate_embedding:
                weight = draft.get_input_embeddings().weight.detach().float().clone()
                self.embeddings = torch.nn.Embedding.from_pretrained(weight, freeze=True)
        if self.head is None:
            self.build(found, self.embeddings.embedding_dim if self.embeddings is not None else 0)
        self.hparams.role = role_of(self.purpose, data.children)  # what it is trained on: where a decoder may use it
        self.head.set_role(self.hparams.role)
        if stage == "fit":
            self.require_a_batch(data)
            self.fit_statistics(data)
            log_dir = self.trainer.log_dir  # a collective call: every rank asks
            if self.trainer.is_global_zero and log_dir:
                data.write_split(Path(log_dir))

    def require_a_batch(self, data: Any) -> None:
        """Refuse, before fitting, a training split too small for one global batch (training would take no step)."""
        rows, ranks = len(data.splits["train"]), self.trainer.world_size
        if rows < data.batch_size * ranks:
            raise UsageError(f"the training split of {data.path} holds {rows} rows, fewer than one batch of "
                             f"data.batch_size {data.batch_size} x {ranks} process(es); lower --data.batch_size to at "
                             f"most {max(rows // ranks, 1)} or label more prompts")

    def match_state_layer(self, data: Any) -> None:
        """Read the draft state the data holds; refuse a head configured for another one."""
        layer, head_args = data.state_layer, dict(self.hparams.head_args or {})
        asked = head_args.get("state_layer")
        if asked is not None and asked != layer:
            raise UsageError(f"model.head_args.state_layer is {asked} but {data.path} holds the draft state "
                             f"{describe_state(layer)}; drop the setting or "
                             f"regenerate the data with `specheads gen --state_layer {asked}`")
        if layer is not None:
            self.hparams.head_args = {**head_args, "state_layer": layer}
        if self.head is not None and self.head.state_layer != layer:
            self.head = None  # built from the config before the data said which state it holds

    def match_target_states(self, data: Any) -> None:
        """With `target_state`: the data must hold the target's states; the head reads them at the target's width."""
        if not self.hparams.target_state:
            return
        if not data.target_states or data.mode != "offline":
            raise UsageError(f"model.target_state reads the target's stored states, but {data.path} holds none (or is "
                             "read online); label it with `specheads gen --target_states true`, or set it false")
        data.with_target_states = True
        self.hparams.head_args = {**dict(self.hparams.head_args or {}), "target_state_size": data.target_hidden_size}
        if self.head is not None and self.head.target_state_size != data.target_hidden_size:
            self.head = None

    def match_markov(self, data: Any) -> None:
        """A head with a `markov_rank` (dspark_confidence) reads the data's Markov embedding (`markov_features`, from a
        DSpark drafter): rank null takes the data's; a rank the data does not store is refused."""
        if "markov_rank" not in inspect.signature(head_class(self.hparams.head)).parameters:
            return
        head_args = dict(self.hparams.head_args or {})
        rank = data.markov_rank if head_args.get("markov_rank") is None else head_args["markov_rank"]
        if rank and rank != data.markov_rank:
            stored = f"a Markov embedding of rank {data.markov_rank}" if data.markov_rank else "no Markov embedding"
            raise UsageError(f"model.head_args.markov_rank is {rank} but {data.path} stores {stored}; set it to "
                             f"{data.markov_rank} or null (the data's), or label the data with that DSpark drafter")
        self.hparams.head_args = {**head_args, "markov_rank": rank}
        data.with_markov = rank > 0
        if self.head is not None and getattr(self.head, "markov_rank", rank) != rank:
            self.head = None

    def fit_statistics(self, data: Any) -> None:
        """Input standardisation and the constant predictor, from the training split's labelled tokens."""
        signals, labels = [], []
        for batch in data.ordered_batches("train", with_features=False, rows_per_batch=256):
            mask, label = token_targets(batch, self.purpose, self.hparams.tau, self.hparams.contexts)
            signals.append(torch.stack([batch[name][mask] for name in SIGNALS], -1))
            labels.append(label[mask])
        signals_all, labels_all = torch.cat(signals), torch.cat(labels)
        if not len(labels_all):
            raise UsageError(f"the training split of {data.path} has no labelled token for a {self.reads} head "
                             "(SPRINTER with contexts=consistent needs rows with mixing ratio 1: --mixing.schedule); "
                             "use other data or model.contexts all")
        chosen = signals_all[:, self.signal_index].double()
        if self.signal_index:
            self.head.set_signal_statistics(chosen.mean(0).float(), chosen.std(0).nan_to_num(1.0).float())
        statistics = self.input_statistics(data)
        self.head.set_hidden_statistics(*statistics[0])
        if self.head.target_state_size:
            self.head.set_target_statistics(*statistics[1])
        self.head.set_class_weights(self.hparams.w_acc, self.hparams.w_rej)
        self.constant = float(labels_all.double().mean())
        if self.hparams.start_from_signals:
            probe = signal_probe(self.head.standardised_signals(chosen.float()), labels_all,
                                 self.hparams.w_acc, self.hparams.w_rej)
            if probe is not None:
                self.head.start_at_signal_probe(*probe)

    @torch.no_grad()
    def input_statistics(self, data: Any, max_batches: int = 64) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per-dimension (mean, std) of the head's input states over (up to `max_batches` of) the training split: the
        draft's, then the target's when the head reads it, in one pass."""
        sums: list[list[Any]] = []
        for index, batch in enumerate(data.ordered_batches("train", with_features=True)):
            if index == max_batches:
                break
            inputs = self.batch_inputs(batch)
            states = [inputs[0]] + ([inputs[5]] if self.head.target_state_size else [])
            sums = sums or [[0, 0, 0] for _ in states]
            for total, part in zip(sums, states):
                part = part.double().cpu()
                total[0], total[1], total[2] = total[0] + part.sum(0), total[1] + (part**2).sum(0), total[2] + len(part)
        result = []
        for total, squares, count in sums:
            mean = total / count
            result.append((mean.float(), (squares / count - mean**2).clamp_min(0).sqrt().float()))
        return result

    # ---- steps

    def head_inputs(self, batch: dict[str, Any], seed: int | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(logits, labels, mask) over the batch's labelled positions."""
        hidden, signals, embedding, label, mask, target, staleness, markov = self.batch_inputs(batch, seed)
        return self.head(hidden, signals, embedding, target, staleness, **markov), label, mask

    def batch_inputs(self, batch: dict[str, Any], seed: int | None = None) -> tuple[Any, ...]:
        """(hidden, signals, candidate embedding, label, mask, target state, staleness, Markov keyword) of the batch's
        labelled positions (`head_inputs`); target state and staleness are None unless the head reads the target's
        state, whose staleness is drawn at random while training and fixed by `seed` (the batch's index) for
        validation and calibration; the last is `markov_argument`'s keyword for the head (empty unless it reads a
        DSpark drafter's Markov embedding)."""
        features = batch["features"] if "features" in batch else self.draft_features(batch, batch["valid"].shape[1])
        inputs = head_inputs(batch, features, self.reads, self.purpose, self.head.extra_features, self.hparams.tau,
                             self.hparams.contexts, self.embeddings)
        markov = markov_argument(batch, inputs[4], self.reads, self.head)
        if not self.head.target_state_size:
            return (*inputs, None, None, markov)
        return (*inputs, *stale_target_states(batch, inputs[4], TARGET_STALENESS, seed), markov)

    def draft_features(self, batch: dict[str, Any], width: int) -> torch.Tensor:
        """Online mode: the frozen draft's states on prompt + mixed tokens, padded like stored features."""
        return draft_features(self.draft_model[0], batch, width, self.head.state_layer)

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        loss, tokens = self.objective(batch)
        if not torch.isfinite(loss):
            self.stop_on_nan(f"the training loss became {loss.item()}")
        self.log("train/loss", loss, prog_bar=True, batch_size=tokens)
        return loss

    def objective(self, batch: dict[str, Any]) -> tuple[torch.Tensor, int]:
        """(the training loss of a batch, its labelled tokens): the weighted BCE (position-weighted with
        `position_gamma`), plus `alpha_weight` × the auxiliary output's BCE against α at the same tokens."""
        hidden, signals, embedding, labels, mask, target, staleness, markov = self.batch_inputs(batch)
        features = self.head.features(hidden, signals, embedding, target, staleness, **markov)
        weights = batch["child_weight"][mask].float() if "child_weight" in batch else None  # second children
        if self.hparams.position_gamma is not None:
            depth = batch["depth"] if "depth" in batch else run_positions(batch["is_draft"])  # a drafter's: its own
            position = position_weights(depth[mask], self.hparams.position_gamma)
            weights = position if weights is None else weights * position
        if self.alpha_out is None:
            return weighted_bce(self.head.score(features), labels, self.hparams.w_acc, self.hparams.w_rej, weights), len(labels)
        trunk = self.head.trunk(features)
        loss = weighted_bce(self.head.out(trunk).squeeze(-1), labels, self.hparams.w_acc, self.hparams.w_rej, weights)
        alpha = batch["beta"][mask].float()
        auxiliary = weighted_bce(self.alpha_out(trunk).squeeze(-1), alpha, 1.0, 1.0, weights)
        return loss + self.hparams.alpha_weight * auxiliary, len(labels)

    def stop_on_nan(self, what: str) -> None:
        """Stop the run with a message that names the step and the likely cause."""
        raise UsageError(f"{what} at step {self.global_step} (epoch {self.current_epoch}, model.lr "
                         f"{self.hparams.lr:.2e}): likely a "
                         "learning rate too high (lower model.lr) or non-finite stored features (fp16 overflow: "
                         "regenerate the data or train online)")

    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        logits, labels, mask = self.head_inputs(batch, seed=batch_idx)
        weights = batch["child_weight"][mask].float() if "child_weight" in batch else None  # as the training loss
        self.log("val/loss", weighted_bce(logits, labels, self.hparams.w_acc, self.hparams.w_rej, weights),
                 batch_size=len(labels), sync_dist=True)
        values = {"prediction": self.head.probabilities(logits.float()), "label": labels,
                  **{name: batch[name][mask] for name in STORED_SIGNALS}}
        for name, value in values.items():
            self.validation[name].update(value.float())

    def on_validation_epoch_end(self) -> None:
        gathered = {name: metric.compute().cpu().numpy().astype(np.float64) for name, metric in self.validation.items()}
        for metric in self.validation.values():
            metric.reset()
        label, prediction = gathered["label"], gathered["prediction"]
        if not np.isfinite(prediction).all():
            self.stop_on_nan("the validation predictions became NaN")
        metrics = {"val/binary_kl": binary_kl(label, prediction), "val/auc": soft_auc(label, prediction),
                   "val/ece": expected_calibration_error(label, prediction, self.hparams.ece_bins),
                   "val/tokens": float(len(label)), "val/mean_label": float(label.mean())}
        if not math.isnan(self.constant):
            metrics["val/binary_kl_constant"] = binary_kl(label, np.full_like(label, self.constant))
        for name, scores in baseline_scores(gathered["logq"], gathered["entropy"], gathered["top1"]).items():
            metrics[f"val/auc_{name}"] = soft_auc(label, scores)
        auc = metrics.pop("val/auc")
        # every rank computed the same values from the gathered tokens; the sync only keeps Lightning content
        self.log_dict(metrics, prog_bar=False, sync_dist=True)
        self.log("val/auc", auc, prog_bar=True, sync_dist=True)
        if self.hparams.calibrate_positions and not self.trainer.sanity_checking:
            self.fit_calibration()

    @torch.no_grad()
    def fit_calibration(self) -> None:
        """Fit the per-position calibration on the calibration prompts and keep it with the head and in the
        hyperparameters, so that every checkpoint carries the map that fits its weights. Every rank fits the same
        map from the same ordered rows."""
        data = self.trainer.datamodule
        logits, accept, first, depths, rows, positions, offset = [], [], [], [], [], [], 0
        for index, batch in enumerate(data.ordered_batches("calibration", with_features=True)):
            batch = {k: v.to(self.device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
            hidden, signals, embedding, label, mask, target, staleness, markov = self.batch_inputs(batch, seed=index)
            logits.append((self.head(hidden, signals, embedding, target, staleness, **markov)
                           + self.head.logit_correction).double().cpu())
            accept.append(label.double().cpu())
            if "first_accept" in batch:
                first.append(batch["first_accept"][mask].double().cpu())
            if "depth" in batch:
                depths.append(batch["depth"][mask].cpu())
            row, position = mask.nonzero(as_tuple=True)
            rows.append((row + offset).cpu())
            positions.append(position.cpu())
            offset += len(mask)
        columns = [torch.cat(part).numpy() for part in (logits, accept, rows, positions)]
        depth = torch.cat(depths).numpy() if depths else None
        calibration = (fit_sibling_calibration(*columns[:2], torch.cat(first).numpy(), *columns[2:],
                                               self.hparams.calibrate_positions, depth) if first else
                       fit_position_calibration(*columns, self.hparams.calibrate_positions, depth))
        self.head.set_calibration(calibration)
        self.hparams.head_args = {**(self.hparams.head_args or {}), "calibration": calibration.as_dict()}

    # ---- optimisation

    def configure_optimizers(self) -> dict[str, Any]:
        optimizer_class = torch.optim.AdamW if self.hparams.optimizer == "adamw" else torch.optim.Adam
        parameters = [*self.head.parameters(), *(self.alpha_out.parameters() if self.alpha_out is not None else [])]
        optimizer = optimizer_class(parameters, lr=self.hparams.lr, weight_decay=self.hparams.weight_decay)
        total = max(int(self.trainer.estimated_stepping_batches), 1)
        schedule = get_cosine_schedule_with_warmup(optimizer, int(self.hparams.warmup_ratio * total), total)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """Only the head's weights (the validation accumulators and frozen embeddings are not state)."""
        state = super().state_dict(*args, **kwargs)
        return {k: v for k, v in state.items() if k.startswith("head.") or k == "head"}

    def load_state_dict(self, state_dict: dict[str, Any], strict: bool = True, assign: bool = False) -> Any:
        """Load the head's weights; strict about the head, indifferent to the rest."""
        result = super().load_state_dict(state_dict, strict=False, assign=assign)
        missing = [key for key in result.missing_keys if key.startswith("head.")]
        unexpected = [key for key in result.unexpected_keys if key.startswith("head.")]
        if strict and (missing or unexpected):
            raise UsageError(f"the checkpoint does not fit this head (missing {missing[:3]}, unexpected {unexpected[:3]}); "
                             "load it with the config it was trained with")
        return result
