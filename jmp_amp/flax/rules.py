"""Per-module policy rules: which `Policy` each module of a Flax model gets.

A rules mapping goes from a *key* to a *policy*:

* key: a module class (``nnx.LayerNorm``, ``nn.Dense``), matched with
  `isinstance`; or a path pattern (a `str`), matched against the module's
  '/'-joined path in the model, e.g. ``"head"``, ``"blocks/0/attn"``,
  ``"blocks/*/attn"``. The root module's path is ``""``. The key ``"*"``
  alone is the catch-all default (see below).
* policy: a `jmp_amp.Policy`, a policy string (``"float32"``,
  ``"mixed_bfloat16"``, ``"p=f32,c=bf16,o=f32"``), or None to leave the
  matched modules as they are. For NNX models also FP8: ``"float8"`` or a
  `jmp_amp.flax.fp8.FP8Policy` (its recipe and other options): the matmul
  modules it decides run in FP8, except the model's
  first and last, and the rest of what it decides in bfloat16 (see
  `jmp_amp.flax.fp8`).

Path patterns: the one glob dialect of `jmp_amp.flax`. A pattern matches a
whole path, segment by segment: ``*`` matches within one segment, ``?`` one
character of a segment, ``[abc]`` / ``[!abc]`` / ``[0-9]`` a character class,
and ``**`` any number of segments (``"blocks/**"`` is everything inside
``blocks``, ``"**/attn"`` an ``attn`` at any depth). So ``"*/out"`` matches
``"mlp/out"`` but not ``"blocks/0/mlp/out"``, which ``"**/out"`` matches.

Scanned stacks (blocks stacked by `nnx.vmap`, run by `nnx.scan`): a module
of the stack, ``blocks/attn`` say, goes by its paths in the blocks,
``blocks/0/attn`` ... ``blocks/N-1/attn`` as in the unscanned model, and by
its own path written out exactly. Rules that decide the blocks of a stack
differently raise ValueError: one program runs them all.

Resolution, for each module:

1. The most specific rule whose key matches the module wins, wherever it
   sits in the mapping: an exact path (a pattern without wildcards)
   outranks a glob, a glob outranks a module class, and a class outranks
   its base classes. Two matching rules of equal rank (two globs, or two
   classes neither of which subclasses the other) are ambiguous: applying
   the rules raises ValueError naming both rules and the path, as Keras's
   ``DTypePolicyMap`` does.
2. Otherwise the module inherits the policy of its nearest ancestor that a
   rule matched, so ``{"head": "float32"}`` covers the layers inside ``head``.
   Except from ``""``: that pattern names the root alone, for the model's own
   boundary (see below), e.g. ``{"": "p=f32,c=bf16,o=f32"}``.
3. Otherwise the catch-all key ``"*"`` applies, wherever it sits in the
   mapping: it is the default, the weakest rule.
4. Otherwise the module is left as it is.

What the model returns. The catch-all ``"*"`` never casts the outputs of the
root module: the model returns what its last layers compute. So pinning the
head to float32 gives float32 logits, with no extra rule:
``{nnx.BatchNorm: "float32", nnx.LayerNorm: "float32", "head": "float32",
"*": "mixed_bfloat16"}`` returns float32, and ``mixed_rules()`` (head under
``"*"``) returns bfloat16. Only a rule that names the root (``""``, the
model's class, or `mixed_rules`'s ``model_output``) sets the dtype of the
model's outputs. Inside the model, each module returns its own policy's
output dtype (see `jmp_amp.flax.nnx` for what NNX modules can express).

Example:
  >>> import jmp_amp.flax
  >>> from jmp_amp import models
  >>> gpt = models.GPT(vocab_size=32, d_model=16, num_heads=2, num_layers=2,
  ...                  max_len=8, rngs=nnx.Rngs(0))
  >>> rules = {"blocks/*/mlp": "float8",           # FP8 MLPs
  ...          "blocks/0/mlp": "mixed_bfloat16",   # but not the first one
  ...          nnx.LayerNorm: "float32", "*": "mixed_bfloat16"}
  >>> tokens = jnp.zeros((2, 8), jnp.int32)  # finds the first/last matmul
  >>> policies = jmp_amp.flax.get_policies(
  ...     jmp_amp.flax.set_policies(gpt, rules, example_args=(tokens,)))
  >>> [str(policies[p]) for p in ("blocks/0/mlp/fc", "blocks/1/mlp/fc",
  ...                             "blocks/1/ln1")]
  ['p=f32,c=bf16,o=bf16', 'float8', 'p=f32,c=f32,o=f32']
  >>> jmp_amp.flax.set_policies(gpt, {"blocks/*/attn": "float32",
  ...                                 "blocks/0/*": "bfloat16"})
  Traceback (most recent call last):
  ...
  ValueError: jmp_amp.flax: module 'blocks/0/attn' matches two rules of
  equal rank, 'blocks/*/attn' -> p=f32,c=f32,o=f32 and 'blocks/0/*' -> ...
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Iterable, Mapping, Optional, Sequence, Union
import warnings

from flax import linen as nn
from flax import nnx

import jmp_amp
from jmp_amp import Policy
from jmp_amp._src import fp8 as fp8_core
from jmp_amp.flax import _fp8_op as fp8_op_lib
from jmp_amp.flax._paths import compile_pattern

DEFAULT_KEY = "*"
ROOT_KEY = ""

PolicyLike = Union[Policy, fp8_op_lib.FP8Policy, str, None]
RuleKey = Union[type, str]


def _norm_classes() -> tuple[type, ...]:
  names = ("BatchNorm", "LayerNorm", "RMSNorm", "GroupNorm", "InstanceNorm")
  return tuple(getattr(mod, n) for mod in (nnx, nn) for n in names
               if hasattr(mod, n))


NORM_CLASSES: tuple[type, ...] = _norm_classes()


class PolicyRules(dict):
  """An ordered rules dict that remembers which rules are optional.

  Optional rules (the norm rules of `mixed_rules`) raise no warning when they
  match no module, so one rule set fits models with and without, say,
  BatchNorm. `|` and `copy` keep the optional marks, so extending a rule set
  stays quiet: ``mixed_rules() | {"head": "float32"}``.

  Example:
    >>> from jmp_amp.flax.rules import PolicyRules
    >>> rules = PolicyRules({nnx.Dropout: "float32", "*": "bf16"},
    ...                     optional=[nnx.Dropout])
    >>> (rules | {"head": "float32"}).optional == {nnx.Dropout}
    True
  """

  def __init__(self, rules: Union[Mapping[RuleKey, PolicyLike],
                                  Iterable[tuple[RuleKey, PolicyLike]]] = (),
               optional: Iterable[RuleKey] = ()):
    super().__init__(rules)
    self.optional = frozenset(optional) | frozenset(
        getattr(rules, "optional", ()))

  def copy(self) -> PolicyRules:
    return PolicyRules(self, optional=self.optional)

  def __or__(self, other):
    if not isinstance(other, Mapping):
      return NotImplemented
    merged = PolicyRules(self, optional=self.optional)
    merged.update(other)
    merged.optional = (self.optional - set(other)) | frozenset(
        getattr(other, "optional", ()))
    return merged

  def __ror__(self, other):
    if not isinstance(other, Mapping):
      return NotImplemented
    merged = PolicyRules(other, optional=getattr(other, "optional", ()))
    merged.update(self)
    merged.optional = (merged.optional - set(self)) | self.optional
    return merged

  def __repr__(self) -> str:
    return f"PolicyRules({dict.__repr__(self)}, optional={set(self.optional)})"


def mixed_rules(compute: Any = "bfloat16", *, param: Any = "float32",
                output: Any = None, norms: PolicyLike = "float32",
                model_output: Any = None) -> PolicyRules:
  """The default rules: norms in float32, everything else in `compute`.

  Normalisation layers (BatchNorm, LayerNorm, RMSNorm, GroupNorm,
  InstanceNorm; NNX and linen) compute their statistics and outputs in
  float32; BatchNorm's running statistics stay float32 under any policy.
  The norm rules are optional: they warn about nothing in models without
  norms.

  Example:
    >>> from jmp_amp.flax import mixed_rules
    >>> rules = mixed_rules(model_output="float32")
    >>> str(rules[""]), str(rules[nnx.LayerNorm]), str(rules["*"])
    ('p=f32,c=bf16,o=f32', 'p=f32,c=f32,o=f32', 'p=f32,c=bf16,o=bf16')

  Args:
    compute: compute dtype of the catch-all rule ("bfloat16", "float16").
    param: param (master weight) dtype of the catch-all rule.
    output: output dtype of the catch-all rule; default `compute`, as in
      Keras' "mixed_bfloat16".
    norms: policy of the normalisation layers.
    model_output: if given, the dtype the model as a whole returns (a rule
      ``""`` for the root, which its submodules do not inherit), e.g.
      "float32" for float32 logits from a mixed model. linen casts any
      root's outputs; an NNX root casts them in a method decorated with
      `jmp_amp.flax.cast_boundary` (`set_policies` warns if it has none).
      Pinning the head instead (``mixed_rules() | {"head": "float32"}``)
      needs no cast at the root.

  Returns:
    A `PolicyRules` with the root rule (if any), then the norm rules, and
    ``"*"`` last.
  """
  default = Policy(param, compute, compute if output is None else output)
  norm_policy = resolve_policy("norms", norms)
  rules = {}
  if model_output is not None:
    rules[ROOT_KEY] = default.with_output_dtype(model_output)
  rules.update({cls: norm_policy for cls in NORM_CLASSES})
  rules[DEFAULT_KEY] = default
  return PolicyRules(rules, optional=NORM_CLASSES)


# --------------------------------------------------------------------------
# Validation.


def resolve_policy(key: Any, value: Any, *, fp8: bool = True
                   ) -> Union[Policy, fp8_op_lib.FP8Policy, None]:
  """A rule's value as a `Policy` or `FP8Policy` (None stays None).

  Args:
    key: the rule's key (for messages).
    value: the rule's value.
    fp8: whether FP8 values ("float8", `FP8Policy`) are accepted (NNX) or
      rejected (linen).

  Raises:
    ValueError: naming the rule and what is accepted.
    TypeError: the value is a bare `FP8Recipe`, not an `FP8Policy`.
  """
  if value is None or isinstance(value, Policy):
    return value
  fp8_policy = fp8_op_lib.as_fp8_policy(value, describe_key(key))
  if fp8_policy is not None:
    if not fp8:
      raise ValueError(
          f"Rule {describe_key(key)} asks for FP8 ({value!r}), which "
          "jmp_amp.flax applies to NNX models only (set_policies); for "
          "linen use jmp_amp.autocast(apply_fn, 'float8').")
    return fp8_policy
  if isinstance(value, str):
    try:
      return jmp_amp.get_policy(value)
    except ValueError as e:
      raise ValueError(
          f"Invalid policy {value!r} for rule {describe_key(key)}: {e} Rules "
          "also accept 'float8' (FP8 matmuls).") from None
  raise ValueError(
      f"Rule {describe_key(key)} has value {value!r} of type "
      f"{type(value).__name__}; expected a jmp_amp.Policy, a policy string "
      "such as 'mixed_bfloat16' or 'p=f32,c=bf16,o=f32', 'float8' (or a "
      "jmp_amp.flax.fp8.FP8Policy), or None.")


def describe_key(key: Any) -> str:
  if isinstance(key, type):
    framework = "linen" if issubclass(key, nn.Module) else "nnx"
    if key.__module__.startswith("flax."):
      return f"{framework}.{key.__qualname__}"
    return f"{key.__module__}.{key.__qualname__}"
  return repr(key)


# Ranks of rules that match a module directly: the highest wins.
CLASS_RANK, GLOB_RANK, PATH_RANK = 0, 1, 2
_WILDCARDS = frozenset("*?[")


@dataclasses.dataclass(frozen=True)
class Rule:
  """One validated rule."""
  key: RuleKey
  policy: Union[Policy, fp8_op_lib.FP8Policy, None]
  regex: Optional[re.Pattern]
  optional: bool

  @property
  def rank(self) -> int:
    """How specific the key is: an exact path, a glob, or a class."""
    if isinstance(self.key, type):
      return CLASS_RANK
    return GLOB_RANK if _WILDCARDS & set(self.key) else PATH_RANK

  def matches(self, path: str, module: Any) -> bool:
    if self.regex is None:
      return isinstance(module, self.key)
    return self.regex.match(path) is not None


@dataclasses.dataclass(frozen=True)
class RuleSet:
  """Validated rules: the ordered explicit rules and the catch-all default."""
  rules: tuple[Rule, ...]
  default: Optional[Rule]

  @property
  def all_rules(self) -> tuple[Rule, ...]:
    return self.rules + ((self.default,) if self.default else ())


def validate_rules(rules: Any, *, fp8: bool = True) -> RuleSet:
  """Checks a rules mapping eagerly and compiles its patterns.

  A lone `Policy`, policy string or FP8 value means ``{"*": policy}``;
  FP8 values are rejected unless `fp8` (see `resolve_policy`).

  Raises:
    TypeError: `rules` is not a mapping/policy, or a key is neither a module
      class nor a str.
    ValueError: a value is not a policy, or a pattern is malformed.
  """
  if isinstance(rules, (Policy, str, fp8_op_lib.FP8Policy,
                        fp8_core.FP8Recipe)):
    rules = {DEFAULT_KEY: rules}
  if not isinstance(rules, Mapping):
    raise TypeError(
        "rules must be a mapping {module class or path pattern: policy}, a "
        f"Policy or a policy string; got {type(rules).__name__}: {rules!r}")
  optional = getattr(rules, "optional", frozenset())
  compiled, default = [], None
  for key, value in rules.items():
    if isinstance(key, type):
      if not issubclass(key, (nnx.Module, nn.Module)):
        raise TypeError(
            f"Rule key {describe_key(key)} is a class but not a Flax module "
            "class (nnx.Module or linen Module subclass).")
      regex = None
    elif isinstance(key, str):
      regex = None if key == DEFAULT_KEY else compile_pattern(key)
    else:
      raise TypeError(
          f"Rule key {key!r} of type {type(key).__name__} is neither a module "
          "class (e.g. nnx.LayerNorm) nor a path pattern str (e.g. "
          "'blocks/*/attn').")
    rule = Rule(key, resolve_policy(key, value, fp8=fp8), regex,
                key in optional)
    if key == DEFAULT_KEY:
      default = rule
    else:
      compiled.append(rule)
  return RuleSet(tuple(compiled), default)


# --------------------------------------------------------------------------
# Resolution.


@dataclasses.dataclass(frozen=True)
class Resolution:
  """How one module got its policy.

  Attributes:
    policy: the policy, or None (module left as is).
    rule: the rule that decided it (None when nothing matched).
    source: "rule" (matched directly), "inherited" (from an ancestor matched
      by `rule`), "default" (the "*" rule) or "none".
    inheritable: whether submodules without a rule of their own inherit it:
      true for rules matching a module other than the root.
  """
  policy: Optional[Policy]
  rule: Optional[Rule]
  source: str
  inheritable: bool = False


NO_POLICY = Resolution(None, None, "none")


def most_specific(rules: Sequence[Rule], path: str) -> Rule:
  """The rule of highest rank among `rules`, which all match `path`.

  Raises:
    ValueError: two of them are equally specific (naming both and `path`).
  """
  top = max(rule.rank for rule in rules)
  best = [rule for rule in rules if rule.rank == top]
  if top == CLASS_RANK:  # A subclass is more specific than its bases.
    best = [rule for rule in best if not any(
        other.key is not rule.key and issubclass(other.key, rule.key)
        for other in best)]
  if len(best) > 1:
    first, second = best[:2]
    raise ValueError(
        f"jmp_amp.flax: module {path or '<root>'!r} matches two rules of "
        f"equal rank, {describe_key(first.key)} -> {first.policy} and "
        f"{describe_key(second.key)} -> {second.policy}, and neither is "
        "more specific (an exact path outranks a glob, a glob a module "
        "class, a class its bases). Make one of them more specific (e.g. "
        "a rule for this exact path) or drop one.")
  return best[0]


def resolve(ruleset: RuleSet, path: str, module: Any,
            parent: Optional[Resolution], aliases: tuple = ()) -> Resolution:
  """The policy of one module, given its parent's resolution (or None).

  `aliases`: other paths of the module that rules naming a path exactly
  match too (a module of a scanned stack is resolved under each of its block
  paths, with its own path as an alias).
  The pattern ``""`` names the root alone and is not inherited: it sets the
  model's own input/output casts, e.g. ``{"": "p=f32,c=bf16,o=f32"} |
  mixed_rules()`` returns float32 outputs from an otherwise mixed model.

  Raises:
    ValueError: the module matches two rules of equal rank.
  """
  matching = [rule for rule in ruleset.rules if rule.matches(path, module)
              or (rule.rank == PATH_RANK and rule.key in aliases)]
  if matching:
    rule = most_specific(matching, path)
    return Resolution(rule.policy, rule, "rule",
                      inheritable=rule.key != ROOT_KEY)
  if parent is not None and parent.inheritable:
    return Resolution(parent.policy, parent.rule, "inherited",
                      inheritable=True)
  if ruleset.default is not None:
    return Resolution(ruleset.default.policy, ruleset.default, "default")
  return NO_POLICY


def casts_output(path: str, resolution: Resolution) -> bool:
  """Whether a module's boundary casts its outputs to the output dtype.

  Every module's does, except the root's under the catch-all ``"*"``: the
  model returns what its last layers compute (see the module docstring).
  """
  return not (path == ROOT_KEY and resolution.source == "default")


def report_unmatched(ruleset: RuleSet, used: set, candidates: Sequence[tuple[
    str, Any]], *, strict: bool, what: str) -> None:
  """Warns (or raises if `strict`) about rules that decided no module.

  Args:
    ruleset: the validated rules.
    used: keys of the rules that decided at least one module directly.
    candidates: (path, module) pairs, to say whether a rule that decided
      nothing matched modules that more specific rules decided.
    strict: raise ValueError instead of warning.
    what: how to name the model in the message.
  """
  problems = []
  # A catch-all that catches nothing is not a mistake, so "*" never warns.
  for rule in ruleset.rules:
    if rule.key in used or rule.optional:
      continue
    matched = [p for p, m in candidates if rule.matches(p, m)]
    if matched:
      why = (f"every module it matches (e.g. {matched[0] or '<root>'!r}) is "
             "decided by a more specific rule")
    elif isinstance(rule.key, type):
      why = "no module is an instance of it"
    else:
      why = "no module path matches it"
    problems.append(f"rule {describe_key(rule.key)} -> {rule.policy} matched "
                    f"no module of {what}: {why}")
  if not problems:
    return
  msg = "jmp_amp.flax: " + "; ".join(problems) + "."
  if strict:
    raise ValueError(msg)
  warnings.warn(msg, UserWarning, stacklevel=3)
