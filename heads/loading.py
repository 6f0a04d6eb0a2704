"""`load_head`: an exported head folder or Hub repo -> a ready module and its decision rule, safely.

Only `model.safetensors` is ever read (a folder with pickled weights is refused), no remote code runs,
the config's hidden size is checked against the weights before anything is built, and the draft the
caller is about to use can be checked against the one the head was trained for.
"""

from __future__ import annotations

import inspect
import json
from dataclasses import asdict, dataclass
from importlib.resources import files
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from specheads import __version__
from specheads.heads.base import AcceptanceHead, decision_timing
from specheads.heads.registry import head_class
from specheads.heads.roles import ROLES, role_of, roles_for
from specheads.model_outputs.sampling import SamplingTransform
from specheads.plumbing.errors import UsageError
from specheads.plumbing.hub import hub_unreachable, reach_fix, repo_id_problem, repo_id_shaped

WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"

SHIPPED_FOLDER = "shipped"
"""Where the heads that ship with specheads live (package data of specheads.heads), each in a folder named as
`load_head` finds it."""
PICKLED_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")
STOP_RULE = "stop_drafting_when_rejection_risk_above"
COST_RULE = "draft_while_the_next_candidate_pays"
VERIFY_RULE = "call_target_when_acceptance_below"
STOP_RULES = (STOP_RULE, COST_RULE)
"""The rules of a stop head: a tuned threshold on 1 − Π â, or the rule read from the costs (docs/method.md)."""
COST_RULE_MAX_ECE = 0.05
"""The largest calibrated ECE of the survival product Π_{j≤k} â_j, at any round position k up to the rule's max_draft
on held-out prompts, at which export gives a head the cost rule: the rule takes Π â as a probability."""
HEAD_FORMAT = "specheads-head"
HEAD_FORMAT_VERSION = 1
"""The `format` and `format_version` config.json declares (written by `specheads export`); a folder saved by
`save_pretrained` alone declares neither."""
TIMING_FIELDS = ("reads", "decides", "purpose")
"""The fields of config.json that declare when a head decides; each must be what its `head_type`'s class does."""
MAX_DEPTH = 64
"""The most residual blocks a head config may ask for (heads use 0 to 4)."""
MAX_WIDTH = 1 << 16
"""The widest input a head config may ask for: hidden, candidate-embedding, target-state sizes and Markov ranks (wider
than any model's hidden size today)."""
MAX_LAYER = 1 << 10
SIZE_FIELDS = {"hidden_size": (1, MAX_WIDTH), "depth": (0, MAX_DEPTH), "candidate_embedding_size": (0, MAX_WIDTH),
               "target_state_size": (0, MAX_WIDTH), "state_layer": (1, MAX_LAYER), "markov_rank": (0, MAX_WIDTH)}
"""config.json's sizes, each a whole number within its bounds (hidden_size required, the others where present), checked
before anything is built: a config from an untrusted repo cannot make `load_head` allocate without bound."""
OBJECT_FIELDS = ("draft", "target", "sampling", "training_data", "metrics", "training")
"""config.json's fields that are objects where present."""


@dataclass(frozen=True)
class DecisionRule:
    """How a decoder acts on the head's acceptance probabilities â.

    `stop_drafting_when_rejection_risk_above` (SpecDec++ stop heads): end the round once 1 − Π â_j over the
    round's scored candidates exceeds `threshold`, or at `max_draft` candidates (an `at_draft` head has scored
    the candidate just drafted, a `one_step_late` head the ones before it; docs/decoding-core.md).
    `draft_while_the_next_candidate_pays` (calibrated stop heads, `specheads.decoding.cost_rule`): draft one more
    candidate while S_k · μ exceeds ρ · (c + Δv); `threshold` is c = t_draft/t_target, nothing tuned.
    `call_target_when_acceptance_below` (SPRINTER verifiers): send the drafted token to the target
    when its â is below `threshold`; otherwise keep it unverified.
    """

    rule: str
    threshold: float
    tuned: bool
    max_draft: int | None = None
    cost_ratio: float | None = None  # the t_draft/t_target the threshold was tuned for

    def __post_init__(self) -> None:
        fix = "tune it again with `specheads eval`"
        if self.rule not in (*STOP_RULES, VERIFY_RULE):
            raise UsageError(f"unknown decision rule {self.rule!r} (known: {', '.join((*STOP_RULES, VERIFY_RULE))}); "
                             f"{fix}")
        if self.rule == COST_RULE:
            if self.tuned or not (is_number(self.threshold) and 0.0 < self.threshold < 1.0):
                raise UsageError(f"the {COST_RULE} rule's value is the cost ratio t_draft/t_target in (0, 1) and is "
                                 f"tuned nowhere, got {self.threshold!r} (tuned: {self.tuned!r}); re-export the head "
                                 "with `specheads export`")
        # the other rules compare a probability (1 − Π â, or â) with the threshold: outside [0, 1] never or always acts
        elif not (is_number(self.threshold) and 0.0 <= self.threshold <= 1.0):
            raise UsageError(f"the {self.rule} threshold must be a number in [0, 1], got {self.threshold!r}; {fix}")
        if not isinstance(self.tuned, bool):
            raise UsageError(f"the decision rule's `tuned` must be true or false, got {self.tuned!r}; {fix}")
        if self.max_draft is not None and (isinstance(self.max_draft, bool) or not isinstance(self.max_draft, int)
                                           or self.max_draft < 1):
            raise UsageError(f"the decision rule's max_draft must be a whole number >= 1, got {self.max_draft!r}; {fix}")
        if self.cost_ratio is not None and not (is_number(self.cost_ratio) and 0.0 < self.cost_ratio < 1.0):
            raise UsageError(f"the decision rule's cost_ratio must be in (0, 1), got {self.cost_ratio!r}; {fix}")

    @classmethod
    def untuned(cls, purpose: str) -> DecisionRule:
        """The default rule for a head of `purpose` (`stop`, `expect` or `verify`), marked untuned."""
        if purpose != "verify":
            return cls(STOP_RULE, 0.5, tuned=False, max_draft=8)
        return cls(VERIFY_RULE, 0.5, tuned=False)

    def as_dict(self) -> dict[str, Any]:
        """Plain dict for config.json."""
        return asdict(self)


def cost_rule_head_refusal(head: Any) -> str | None:
    """Why this head cannot take the rule read from the costs whatever its calibration measures (None: it can): the
    rule needs a stop head that scores each candidate when drafted and carries a per-position calibration."""
    if getattr(head, "purpose", None) not in ("stop", "expect"):
        return "it is not a stop head"
    if getattr(head, "decides", None) not in ("at_draft", "before_draw"):
        return f"a head that decides {getattr(head, 'decides', None)} knows the survival product a candidate late"
    if head.calibration is None:
        return "its survival product is not calibrated per round position"
    return None


def worst_calibrated(cumulative: list[dict[str, Any]] | None, max_draft: int) -> dict[str, Any] | None:
    """The calibrated row of eval's `cumulative_calibration` with the largest ECE among round positions up to
    `max_draft` (None when none was measured)."""
    rows = [row for row in cumulative or () if row["stage"] == "calibrated" and row["k"] <= max_draft]
    return max(rows, key=lambda row: row["ece"]) if rows else None


def cost_rule_refusal(head: Any, cumulative: list[dict[str, Any]] | None, max_draft: int) -> str | None:
    """Why a stop head keeps a tuned threshold rather than the rule read from the costs (None: the calibration allows
    that rule): `cost_rule_head_refusal`, and its calibrated survival product within COST_RULE_MAX_ECE of the realised
    one at every round position up to `max_draft` on held-out prompts (`cumulative`: eval's `cumulative_calibration`
    rows)."""
    refusal = cost_rule_head_refusal(head)
    if refusal:
        return refusal
    worst = worst_calibrated(cumulative, max_draft)
    if worst is None:
        return "no calibrated survival product was measured on held-out prompts (run `specheads eval`)"
    if worst["ece"] > COST_RULE_MAX_ECE:
        return (f"its calibrated survival product is off by ECE {worst['ece']:.3f} at round position {worst['k']} "
                f"(the rule needs <= {COST_RULE_MAX_ECE})")
    return None


def is_number(value: Any) -> bool:
    """Whether `value` is an int or float (not a bool) and not NaN."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value


def shipped_heads() -> dict[str, Path]:
    """The heads that ship with specheads, by the name `load_head` finds them under."""
    root = Path(str(files("specheads.heads").joinpath(SHIPPED_FOLDER)))
    return {folder.name: folder for folder in sorted(root.iterdir()) if (folder / CONFIG_FILE).is_file()} \
        if root.is_dir() else {}


def resolve_folder(path_or_repo_id: str, revision: str | None = None) -> Path:
    """A shipped head by its name (`shipped_heads`), a local folder (`~` expanded), or the safetensors + config files
    of a Hub repo downloaded to the cache.

    A shipped head's name wins over a folder of that name in the working directory: give the folder as a path
    (`./smollm2-ontime`) to read it. A string that is neither is refused in one line naming what is wrong (an empty
    name, a path that does not exist, a repo id the Hub would not accept)."""
    if not isinstance(path_or_repo_id, str) or not path_or_repo_id.strip():
        raise UsageError(f"no head given ({path_or_repo_id!r}); give a head folder, a Hub repo id (owner/name) or the "
                         f"name of a shipped head ({', '.join(shipped_heads()) or 'none ship'})")
    shipped = shipped_heads()
    if path_or_repo_id in shipped:
        return shipped[path_or_repo_id]
    folder = Path(path_or_repo_id).expanduser()
    if folder.is_dir():
        return folder
    names = (f", nor the name of a shipped head ({', '.join(shipped)}; a folder of that name is read when given as "
             "./NAME)") if shipped else ""
    if folder.exists() or not repo_id_shaped(path_or_repo_id):
        missing = "is not a folder" if folder.exists() else "does not exist"
        raise UsageError(f"{path_or_repo_id} is not a head: {folder} {missing}, and it is no Hub repo id "
                         f"(owner/name){names}; give the folder `specheads export --out` wrote or its repo id")
    problem = repo_id_problem(path_or_repo_id)
    if problem:
        raise UsageError(f"{path_or_repo_id!r} is not a head: no such folder here, and no valid Hub repo id "
                         f"({problem}){names}; give the folder `specheads export --out` wrote or its repo id")
    return downloaded(path_or_repo_id, revision)


def downloaded(repo_id: str, revision: str | None) -> Path:
    """The head files of Hub repo `repo_id` in the local cache, downloaded when the Hub can be reached."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError

    offline = hub_unreachable()  # decided at once: without a network the Hub client retries for minutes
    try:
        local = snapshot_download(repo_id=repo_id, revision=revision, local_files_only=offline is not None,
                                  allow_patterns=[CONFIG_FILE, WEIGHTS_FILE, "README.md"])
    except (HfHubHTTPError, OSError, ValueError) as error:
        if offline:
            raise UsageError(f"cannot load head {repo_id!r}: it is not a local folder nor in the Hugging Face "
                             f"cache, and the Hub cannot be used ({offline}); {reach_fix()}, or give the head's "
                             "folder") from None
        raise UsageError(f"cannot download head {repo_id!r} (revision {revision or 'main'}): "
                         f"{str(error).splitlines()[0]}; check the repo id, the revision and your token") from error
    return Path(local)


def read_head_config(folder: Path) -> dict[str, Any]:
    """The folder's config.json after the file checks (safetensors present, no pickled weights), parsed and its
    fields' types and bounds checked (`check_config_values`)."""
    pickled = sorted(p.name for p in folder.iterdir() if p.suffix in PICKLED_SUFFIXES)
    if pickled:
        raise UsageError(f"{folder} holds pickled weights ({', '.join(pickled)}), which can run code when loaded; "
                         f"only {WEIGHTS_FILE} is loaded: re-export the head with `specheads export`")
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        if not (folder / name).is_file():
            raise UsageError(f"{folder} has no {name}; a head folder holds {CONFIG_FILE} and {WEIGHTS_FILE} "
                             "(write one with `specheads export`)")
    where = folder / CONFIG_FILE
    try:
        config = json.loads((folder / CONFIG_FILE).read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise UsageError(f"{where} is not valid JSON ({error}); re-export the head") from None
    except UnicodeDecodeError as error:
        raise UsageError(f"{where} is not UTF-8 text (byte {error.start}: {error.reason}); re-export the head") from None
    except RecursionError:
        raise UsageError(f"{where} nests its JSON deeper than Python parses; a head config is a few levels deep: "
                         "re-export the head") from None
    if not isinstance(config, dict) or "head_type" not in config:
        raise UsageError(f"{where} names no head_type; it is not a specheads head config: give a "
                         "folder `specheads export` wrote")
    check_config_values(folder, config)
    check_sampling(folder, config)
    return config


def shown(value: Any, width: int = 60) -> str:
    """`value` as JSON, cut to `width` characters, for a refusal."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError, RecursionError):
        text = repr(value)
    return text if len(text) <= width else text[: width - 3] + "..."


def check_config_values(folder: Path, config: dict[str, Any]) -> None:
    """Refuse a config.json field of the wrong type or beyond its bound (`SIZE_FIELDS`), before anything is built: a
    head from an untrusted repo cannot make `load_head` allocate without bound."""
    where, fix = folder / CONFIG_FILE, "re-export the head with `specheads export`"
    if not isinstance(config["head_type"], str):
        raise UsageError(f"{where}: head_type must be a name (a string), got {shown(config['head_type'])}; {fix}")
    for name, (low, high) in SIZE_FIELDS.items():
        value = config.get(name)
        if (value is not None or name == "hidden_size") and (type(value) is not int or not low <= value <= high):
            raise UsageError(f"{where}: {name} must be a whole number in [{low}, {high}], got {shown(value)}; {fix}")
    features = config.get("extra_features")
    if features is not None and not (isinstance(features, list) and all(isinstance(f, str) for f in features)):
        raise UsageError(f"{where}: extra_features must be a list of signal names, got {shown(features)}; {fix}")
    for name in OBJECT_FIELDS:
        if config.get(name) is not None and not isinstance(config[name], dict):
            raise UsageError(f"{where}: {name} must be an object, got {shown(config[name])}; {fix}")


def check_sampling(folder: Path, config: dict[str, Any]) -> None:
    """Refuse a recorded sampling transform that is not one (`SamplingTransform`'s fields and ranges)."""
    sampling = config.get("sampling")
    if sampling is None:
        return
    fields = {name: sampling[name] for name in ("temperature", "top_k", "top_p") if name in sampling}
    try:
        if not all(is_number(value) for value in fields.values()):
            raise UsageError(f"sampling's temperature, top_k and top_p must be numbers, got {shown(fields)}")
        SamplingTransform(**fields)
    except UsageError as error:
        raise UsageError(f"{folder / CONFIG_FILE}: {error}; re-export the head with `specheads export`") from None


def header_shapes(folder: Path) -> dict[str, tuple[int, ...]]:
    """Every tensor's shape in the folder's model.safetensors, read from the file's header (nothing loaded)."""
    try:
        with safe_open(str(folder / WEIGHTS_FILE), framework="pt") as weights:
            return {name: tuple(weights.get_slice(name).get_shape()) for name in weights.keys()}
    except Exception as error:  # safetensors raises SafetensorError (and others) on a file that is not its format
        raise UsageError(f"{folder / WEIGHTS_FILE} is not a safetensors file ({' '.join(str(error).split())[:120]}); "
                         "re-export the head with `specheads export`") from None


def skeleton_shapes(folder: Path, config: dict[str, Any], cls: type[AcceptanceHead]) -> dict[str, tuple[int, ...]]:
    """The names and shapes of the tensors of the head config.json describes, built on the meta device (no memory),
    from the fields its constructor takes, as `from_pretrained` builds it."""
    parameters = inspect.signature(cls).parameters
    try:
        with torch.device("meta"):
            head = cls(**{name: value for name, value in config.items() if name in parameters})
    except UsageError as error:
        raise UsageError(f"{folder / CONFIG_FILE}: {error}") from None
    except (TypeError, ValueError, KeyError, AttributeError, IndexError) as error:
        raise UsageError(f"{folder / CONFIG_FILE}: the {cls.head_type} head's fields are malformed "
                         f"({' '.join(str(error).split())[:120]}); re-export the head with `specheads export`") from None
    return {name: tuple(tensor.shape) for name, tensor in head.state_dict().items()}


def check_weights_fit(folder: Path, config: dict[str, Any], cls: type[AcceptanceHead]) -> None:
    """Refuse weights whose tensors (names and shapes, from the safetensors header) are not those of the head
    config.json describes, before the head is built."""
    found, expected = header_shapes(folder), skeleton_shapes(folder, config, cls)
    if "hidden_mean" not in found:
        raise UsageError(f"{folder / WEIGHTS_FILE} holds no specheads head (no hidden_mean tensor)")
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(set(found) - set(expected))
    wrong = [f"{name} {list(found[name])} (config: {list(shape)})" for name, shape in sorted(expected.items())
             if name in found and found[name] != shape]
    differs = [f"{what} {', '.join(names[:3])}{' ...' if len(names) > 3 else ''}"
               for what, names in (("missing", missing), ("unexpected", unexpected), ("shaped", wrong)) if names]
    if differs:
        raise UsageError(f"{folder}: the weights do not fit config.json (hidden_size {config.get('hidden_size')}, "
                         f"depth {config.get('depth')}): {'; '.join(differs)}; the files do not belong together, "
                         "re-export the head")


def check_format(folder: Path, config: dict[str, Any]) -> None:
    """Refuse a config.json of another format, or of a format version this specheads does not know."""
    where = folder / CONFIG_FILE
    found, version = config.get("format", HEAD_FORMAT), config.get("format_version", HEAD_FORMAT_VERSION)
    if found != HEAD_FORMAT:
        raise UsageError(f"{where} declares format {found!r}, not {HEAD_FORMAT!r}; it is not a specheads head config: "
                         "give a folder `specheads export` wrote")
    if type(version) is not int or version < 1:
        raise UsageError(f"{where} declares format_version {version!r}, not a version number; re-export the head "
                         "with `specheads export`")
    if version != HEAD_FORMAT_VERSION:
        raise UsageError(f"{where} declares head format_version {version}, which specheads {__version__} does not "
                         f"read (it reads {HEAD_FORMAT_VERSION}); upgrade specheads, or re-export the head with this one")


def check_declared_timing(folder: Path, config: dict[str, Any], cls: type[AcceptanceHead]) -> None:
    """Refuse a config.json whose `reads`, `decides` or `purpose` contradicts its `head_type`: a decoder times its
    stop decisions by the class, so a head of one timing loaded as another decodes with scores it does not have yet.
    `reads` is written by every specheads version; `decides` and `purpose` are checked where present."""
    expected = {"reads": cls.reads, "decides": decision_timing(cls.purpose, cls.reads), "purpose": cls.purpose}
    declared = {name: config.get(name) for name in TIMING_FIELDS}
    differs = [f"{name} {declared[name]!r}" for name in TIMING_FIELDS
               if declared[name] != expected[name] and (declared[name] is not None or name == "reads")]
    if differs:
        does = ", ".join(f"{name} {value!r}" for name, value in expected.items())
        raise UsageError(f"{folder / CONFIG_FILE} says head_type {cls.head_type!r} but {', '.join(differs)}, and a "
                         f"{cls.head_type} head has {does}: the config was edited or belongs to another head; "
                         "re-export the head with `specheads export`")


def decision_rule_of(folder: Path, config: dict[str, Any], purpose: str) -> DecisionRule:
    """The config's decision rule (checked: known rule, the rule of a head of `purpose`, values in range), or the
    untuned default where it records none."""
    values = config.get("decision_rule")
    untuned = DecisionRule.untuned(purpose)
    if not values:
        return untuned
    where = folder / CONFIG_FILE
    if not isinstance(values, dict):
        raise UsageError(f"{where}: decision_rule must be an object {{rule, threshold, tuned, ...}}, got "
                         f"{json.dumps(values)[:80]}; re-export the head with `specheads export`")
    try:
        rule = DecisionRule(**values)
    except TypeError as error:  # a field missing or unknown
        raise UsageError(f"{where}: decision_rule is malformed ({error}); re-export the head with "
                         "`specheads export`") from None
    except UsageError as error:
        raise UsageError(f"{where}: {error}") from None
    if rule.rule != untuned.rule and not (rule.rule in STOP_RULES and untuned.rule in STOP_RULES):
        raise UsageError(f"{where}: a {purpose} head acts by the rule {untuned.rule}, but decision_rule names "
                         f"{rule.rule}; re-export the head with `specheads export`")
    return rule


def flattened(value: Any, prefix: str = "") -> dict[str, Any]:
    """A nested dict as dotted keys (`weights.spec.skip_layers`)."""
    if not isinstance(value, dict):
        return {prefix: value}
    items: dict[str, Any] = {}
    for key, inner in value.items():
        items.update(flattened(inner, f"{prefix}.{key}" if prefix else str(key)))
    return items


def draft_differences(trained_for: dict[str, Any], expected: dict[str, Any]) -> list[str]:
    """The parts of the `expected` draft identity (`specheads.pair.models.draft_identity`: name, weights, state layer) that
    the head's config.json records otherwise, each said with both values."""
    recorded = flattened(trained_for)
    return [f"{key} ({recorded.get(key)!r} here, {value!r} expected)"
            for key, value in flattened(expected).items() if recorded.get(key) != value]


def recorded_role(folder: Path, config: dict[str, Any], cls: type[AcceptanceHead]) -> tuple[str, bool]:
    """The head's role (`specheads.heads.roles`) and whether config.json records it: the recorded one, checked against
    what the class can be trained for; else, for a head exported before roles were recorded, the one its purpose and
    `training_data.split.children` imply."""
    where, fix = folder / CONFIG_FILE, "re-export the head with `specheads export`"
    recorded = config.get("role")
    if recorded is None:
        split = (config.get("training_data") or {}).get("split")
        children = split.get("children", "first") if isinstance(split, dict) else "first"
        try:
            return role_of(cls.purpose, children), False
        except UsageError as error:
            raise UsageError(f"{where}: training_data.split: {error}; {fix}") from None
    allowed = roles_for(cls.purpose, cls.reads)
    if recorded not in allowed:
        raise UsageError(f"{where} says role {shown(recorded)}, and a {cls.head_type} head can be "
                         f"{' or '.join(allowed)} (known roles: {', '.join(ROLES)}): the config was edited or "
                         f"belongs to another head; {fix}")
    return recorded, True


def check_finite_tensors(folder: Path, head: AcceptanceHead) -> None:
    """Refuse a head whose weights or statistics hold NaN or inf, or a standard deviation of zero or less (its
    inputs are divided by it), naming the tensor: it would score every candidate NaN, and the rules would decide on it."""
    for name, tensor in head.state_dict().items():
        if not tensor.is_floating_point():
            continue
        finite = bool(torch.isfinite(tensor).all())
        if not finite or (name.endswith("_std") and bool((tensor <= 0).any())):
            problem = "NaN or inf" if not finite else "a standard deviation of zero or less"
            raise UsageError(f"{folder / WEIGHTS_FILE}: {name} holds {problem} (a training run that diverged, statistics "
                             "of a constant input, or a float16 overflow at export); retrain the head, or export it "
                             "again in float32")


def load_head(path_or_repo_id: str, revision: str | None = None,
              expect_draft: str | dict[str, Any] | None = None) -> tuple[AcceptanceHead, DecisionRule]:
    """A ready head (eval mode) and its decision rule from a shipped head's name (`shipped_heads`: `smollm2-ontime`,
    the on-time head of the embedded pair's 64x data; it wins over a folder of that name, read as `./NAME`), a head
    folder or a Hub repo id.

    The head carries its `role` (`specheads.heads.roles`: what it was trained on, which decides where a decoder may
    use it) and `trained_for` (the draft, the sampling transform, the purpose and the role its config.json records),
    which a decoder checks against its own. `expect_draft` is the draft the caller will feed the head: its identity as
    export records it (`specheads.pair.models.draft_identity(spec, model, state_layer)`: name, weights, state layer),
    or its name alone. A head trained for another draft is refused naming the part that differs: two
    self-speculative drafts of different targets share a name but not their weights. Everything is checked before
    the head is built: config.json's fields and bounds, and the weights' shapes from the safetensors header.
    """
    folder = resolve_folder(path_or_repo_id, revision)
    config = read_head_config(folder)
    check_format(folder, config)
    cls = head_class(config["head_type"])
    check_declared_timing(folder, config, cls)
    role, role_recorded = recorded_role(folder, config, cls)
    rule = decision_rule_of(folder, config, cls.purpose)
    check_weights_fit(folder, config, cls)
    trained_for = {**(config.get("draft") or {}), "state_layer": config.get("state_layer"),
                   "target_weights": (config.get("target") or {}).get("weights")}
    expected = {"name": expect_draft} if isinstance(expect_draft, str) else expect_draft
    differs = draft_differences(trained_for, expected) if expected is not None else []
    if differs:
        raise UsageError(f"head {path_or_repo_id} was trained for another draft: it differs in {'; '.join(differs)}; "
                         "use a head trained for your draft, or train one")
    try:
        head = cls.from_pretrained(str(folder))
    except (RuntimeError, TypeError, ValueError) as error:  # torch's load_state_dict, should the checks above miss one
        reason = " ".join(str(error).split())[:200]
        raise UsageError(f"{folder}: the weights do not fit config.json (depth {config.get('depth')}): {reason}; the "
                         "files do not belong together, re-export the head") from None
    check_finite_tensors(folder, head)
    head.eval()
    head.set_role(role)
    head.trained_for = {"draft": trained_for, "sampling": config.get("sampling"), "purpose": cls.purpose,
                        "role": role, "role_recorded": role_recorded}
    return head, rule
