"""Tool use during sampling: a completion that writes a tool call gets the tool's answer spliced in, then goes on.

A tool declares how its call ends (`call_end`, e.g. GSM8K's calculator annotation `<<48/2=`) and answers a
completion that ends with a call (`respond`: the text to insert, here `24>>`, or None when no call is open). Sampling
then runs in turns (`ToolUse`): every row decodes until EOS, the generation budget or the token that ends a call;
each row that ended a call gets the tool's answer appended as tokens the policy did not sample, and the rows with
budget left are decoded again from their whole context (prompt, completion so far, answers), re-prefilled by a second
`Sampler` whose prefill covers a prompt and a completion. Rows that are done sit out the later turns (inactive
rows of the decode program). A turn's stop token is the last token of the tokenizer's encoding of the tool's
`example_call`, so a call written the way training data writes calls stops the turn, and a call tokenized otherwise
gets no answer (the policy computes on its own).

What training sees: `Rollouts.sampled` marks the tokens the policy sampled (1) and the inserted answers (0); the
RL rows' `completion_mask` is that mask, so no loss term, KL, entropy or advantage counts the tool's tokens, while
they stay in the context the policy's later tokens are scored in. The sampler's log-probs of the sampled tokens
are those of the whole context, as the trainer's single forward pass scores them (the first iteration's ratio is 1).

This is the calculator loop of Cobbe et al. 2021 (GSM8K), in turns instead of in the token loop: each turn
re-prefills its rows, which costs a prefill per call rather than one per prompt; on the sizes RL runs at, a few
calls per completion, that is a small part of the decode.
"""

import ast
import dataclasses
import importlib
import operator
import re
from typing import Protocol

import jax
import numpy as np
from jax.experimental import multihost_utils

from maxtext_posttrain import config as config_lib
from maxtext_posttrain.data import pipeline
from maxtext_posttrain.rollout import sampler as sampler_lib


class Tool(Protocol):
  """What a tool is to the sampler: how its call ends, and its answer to a completion that ends with a call."""

  name: str
  example_call: str  # a call as the data writes it, up to where the answer starts; its last token ends a turn

  def respond(self, text: str) -> str | None:
    """The text to insert after `text` (a completion so far, ending with this tool's stop token), or None."""


_OPERATORS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}
_MAX_MAGNITUDE = 1e15  # larger numbers (or results) are no arithmetic a word problem needs; no answer
_MAX_CALL_CHARS = 200


def _evaluate(node: ast.AST) -> float:
  """The value of an arithmetic expression tree of numbers, + - * / // % and parentheses; ValueError otherwise."""
  if isinstance(node, ast.Expression):
    return _evaluate(node.body)
  if isinstance(node, ast.Constant) and type(node.value) in (int, float):
    value = node.value
  elif isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
    value = _OPERATORS[type(node.op)](_evaluate(node.left), _evaluate(node.right))
  elif isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
    value = _OPERATORS[type(node.op)](_evaluate(node.operand))
  else:
    raise ValueError(f"not arithmetic: {ast.dump(node)[:80]}")
  if abs(value) > _MAX_MAGNITUDE:
    raise ValueError(f"{value} is out of range")
  return value


def _number(value: float) -> str:
  """GSM8K's way of writing a result: an integer without a decimal point, else at most 6 decimals, trailing zeros
  dropped."""
  if float(value).is_integer():
    return str(int(value))
  return f"{value:.6f}".rstrip("0").rstrip(".")


@dataclasses.dataclass(frozen=True)
class Calculator:
  """GSM8K's calculator annotations (`48/2 = <<48/2=24>>24`): a completion ending in `<<expression=` gets the value
  and `>>`. The expression is parsed, never evaluated as Python: numbers, + - * / // % and parentheses only (GSM8K
  writes `x` for times in prose, `*` in annotations); anything else, a division by zero or a number beyond 1e15
  gets no answer."""

  name: str = "calculator"
  example_call: str = "<<1+1="
  _open_call = re.compile(r"<<([^<>]*)=$")

  def respond(self, text: str) -> str | None:
    match = self._open_call.search(text)
    if match is None or len(match.group(1)) > _MAX_CALL_CHARS:
      return None
    expression = match.group(1).replace(",", "").replace("$", "").strip()
    try:
      value = _evaluate(ast.parse(expression, mode="eval"))
    except (SyntaxError, ValueError, ZeroDivisionError, OverflowError, RecursionError):
      return None
    return f"{_number(value)}>>"


BUILTINS = {"calculator": Calculator}


def load(spec: str) -> Tool:
  """The tool `spec` names: a built-in (BUILTINS) or `package.module:name`, a Tool or a class made with no
  arguments; ConfigError naming the spec otherwise."""
  if spec in BUILTINS:
    return BUILTINS[spec]()
  module_name, colon, attribute = spec.partition(":")
  if not (colon and module_name and attribute):
    raise config_lib.ConfigError(f"rl.tools: unknown tool {spec!r}; expected one of {sorted(BUILTINS)} or 'module:name'.")
  try:
    found = getattr(importlib.import_module(module_name), attribute)
  except (ImportError, AttributeError) as error:
    raise config_lib.ConfigError(f"rl.tools: cannot load tool {spec!r}: {error}") from error
  tool = found() if isinstance(found, type) else found
  missing = [name for name in ("name", "example_call", "respond") if not hasattr(tool, name)]
  if missing:
    raise config_lib.ConfigError(f"rl.tools: {spec!r} is no tool: it has no {', '.join(missing)}.")
  return tool


def stop_id(tool: Tool, encoder: pipeline.Encoder) -> int:
  """The token that ends `tool`'s calls: the last of its `example_call`'s encoding."""
  ids = list(encoder.tokenizer.encode(tool.example_call))
  if not ids:
    raise config_lib.ConfigError(f"rl.tools: {tool.name}'s example_call {tool.example_call!r} encodes to no token.")
  return ids[-1]


def answer_ids(encoder: pipeline.Encoder, tool: Tool, answer: str) -> list[int]:
  """`answer`'s tokens as they follow a call: the tokens the example call followed by the answer adds to the example
  call's own (no word-start marker a tokenizer puts at the start of a text), or the answer's own encoding when the
  two share no such boundary."""
  call = list(encoder.tokenizer.encode(tool.example_call))
  both = list(encoder.tokenizer.encode(tool.example_call + answer))
  return both[len(call) :] if both[: len(call)] == call else list(encoder.tokenizer.encode(answer))


def with_tools(sampler: sampler_lib.Sampler, config, encoder: pipeline.Encoder) -> "sampler_lib.Sampler | ToolUse":
  """`sampler`, or with `rl.tools` set, sampling in turns with those tools through it."""
  if not config.rl.tools:
    return sampler
  return ToolUse(sampler, [load(spec) for spec in config.rl.tools], encoder, config.rl.max_tool_calls)


class ToolUse:
  """Sampling with tools in turns (module docstring), on the rollout sampler's mesh."""

  def __init__(self, sampler: sampler_lib.Sampler, tools: list[Tool], encoder: pipeline.Encoder, max_calls: int):
    self.sampler = sampler
    self.tools = tools
    self.encoder = encoder
    self.max_calls = max_calls
    self.stops = {stop_id(tool, encoder): tool for tool in tools}
    budget = config_lib.max_new_tokens(sampler.config)
    # Later turns prefill a prompt and a completion so far: up to max_target_length tokens.
    followup_config = config_lib.with_overrides(
        sampler.config, max_prefill_predict_length=sampler.config.max_prefill_predict_length + budget
    )
    self.followup = sampler_lib.Sampler(followup_config, sampler.mesh)

  def sample(self, *args, **kwargs) -> sampler_lib.Rollouts:
    """`start(...).result()`: samples and waits for the rows; arguments as `start`'s."""
    return self.start(*args, **kwargs).result()

  def start(
      self,
      params,
      prompts: list[list[int]],
      max_new_tokens: int,
      eos_id: int,
      rng: jax.Array,
      sampling: sampler_lib.SamplingParams,
      num_samples: int = 1,
      process_local: bool = False,
      copy_params: bool = False,
  ) -> "PendingToolRollouts":
    """Dispatches the first turn as `Sampler.start` does (same arguments) and returns what finishes the others."""
    params = self.sampler.on_mesh(params, copy=copy_params)  # later turns read the weights the first one did
    first = self.sampler.start(
        params,
        prompts,
        max_new_tokens,
        eos_id,
        rng,
        sampling,
        num_samples=num_samples,
        stop_ids=tuple(self.stops),
        process_local=process_local,
    )
    return PendingToolRollouts(self, first, params, max_new_tokens, eos_id, rng, sampling, process_local)


@dataclasses.dataclass
class PendingToolRollouts:
  """The first turn's dispatched program and what the later turns need; `result()` runs them."""

  tool_use: ToolUse
  first: sampler_lib.PendingRollouts
  params: object
  max_new_tokens: int
  eos_id: int
  rng: jax.Array
  sampling: sampler_lib.SamplingParams
  process_local: bool

  def result(self) -> sampler_lib.Rollouts:
    """Waits for the first turn, then answers calls and decodes again until every row is done."""
    use, budget = self.tool_use, self.max_new_tokens
    out = self.first.result()
    rows = len(out.lengths)
    tokens = [list(map(int, out.tokens[r, : out.lengths[r]])) for r in range(rows)]
    logprobs = [list(map(float, out.logprobs[r, : out.lengths[r]])) for r in range(rows)]
    sampled = [[1] * len(t) for t in tokens]
    calls = np.zeros(rows, np.int32)
    turn_keys = jax.random.split(self.rng)[1]
    for turn in range(1, budget + 1):  # every turn adds a token to each row it decodes
      active = [self._answer(r, tokens, logprobs, sampled, calls) for r in range(rows)]
      if not self._any(active):
        break
      contexts = [out.prompts[r] + tokens[r] if active[r] else [self.eos_id] for r in range(rows)]
      more = use.followup.sample(
          self.params,
          contexts,
          budget,
          self.eos_id,
          jax.random.fold_in(turn_keys, turn),
          self.sampling,
          stop_ids=tuple(use.stops),
          truncate_prompts=False,
          process_local=self.process_local,
          active=active,
      )
      for r in np.flatnonzero(active):
        n = min(int(more.lengths[r]), budget - len(tokens[r]))
        tokens[r] += more.tokens[r, :n].tolist()
        logprobs[r] += more.logprobs[r, :n].tolist()
        sampled[r] += [1] * n
    lengths = np.array([len(t) for t in tokens], np.int32)
    grid = lambda values, dtype: np.array([v + [0] * (budget - len(v)) for v in values], dtype)
    return sampler_lib.Rollouts(
        prompts=out.prompts,
        tokens=grid(tokens, np.int32),
        logprobs=grid(logprobs, np.float32),
        lengths=lengths,
        finish_reasons=["eos" if t and t[-1] == self.eos_id else "length" for t in tokens],
        num_truncated_prompts=out.num_truncated_prompts,
        num_samples=out.num_samples,
        sampled=grid(sampled, np.int8),
        tool_calls=calls,
    )

  def _answer(self, r: int, tokens, logprobs, sampled, calls) -> bool:
    """Appends the tool's answer to row r if it ended a call (within rl.max_tool_calls); whether the row decodes
    again (it stopped at a call's end with budget left)."""
    use, budget = self.tool_use, self.max_new_tokens
    if not tokens[r] or tokens[r][-1] not in use.stops or len(tokens[r]) >= budget:
      return False
    tool = use.stops[tokens[r][-1]]
    answer = tool.respond(use.encoder.decode_completion(tokens[r])) if calls[r] < use.max_calls else None
    if answer is not None:
      ids = answer_ids(use.encoder, tool, answer)[: budget - len(tokens[r])]
      tokens[r] += ids
      logprobs[r] += [0.0] * len(ids)
      sampled[r] += [0] * len(ids)
      calls[r] += 1
    return len(tokens[r]) < budget

  def _any(self, active: list[bool]) -> bool:
    """Whether any row decodes again, on any process (a turn is a collective program when rows are process-local)."""
    count = np.array([sum(active)], np.int32)
    if self.process_local:
      count = multihost_utils.process_allgather(count)
    return bool(np.sum(count))
