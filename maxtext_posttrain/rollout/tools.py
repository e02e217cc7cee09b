"""Tool use during sampling: a completion that writes a tool call gets the tool's answer spliced in, then goes on.

A tool says how its calls are written (`example_call`, e.g. GSM8K's calculator annotation `<<1+1=`) and answers a
completion that ends with a call (`respond`: the text to insert, `24>>` after `<<48/2=`, or None when no call is
open). Sampling then runs in turns (`ToolUse`): every row decodes until EOS, the generation budget or a tool's stop
token (the last token of the tokenizer's encoding of its `example_call`, so a call written the way the data writes
calls ends a turn, and a call tokenized otherwise gets no answer: the policy computes on its own); each row that
stopped there gets the tool's answer appended as tokens the policy did not sample, and the rows with budget left are
decoded again from their whole context (prompt, completion so far, answers), re-prefilled by a second `Sampler`
whose prefill covers a prompt and a completion, while the rows that are done sit out (inactive rows of its decode
program). Each stop of a row counts towards `rl.max_tool_calls` (answered or not), and only stops within it are
answered; once no row has one left, the next turn samples to the end without the tools' stop tokens. A row decoding
in the k-th later turn has stopped k times, so a batch takes `rl.max_tool_calls` + 1 turns at most.

What training sees: `Rollouts.sampled` marks the tokens the policy sampled (1) and the inserted answers (0); the
RL rows' `completion_mask` is that mask, so no loss term, KL, entropy or advantage counts the tool's tokens, while
they stay in the context the policy's later tokens are scored in. The sampler's log-probs of the sampled tokens
are those of the whole context, as the trainer's single forward pass scores them (the first iteration's ratio is 1).

This is the calculator loop of Cobbe et al. 2021 (GSM8K), in turns instead of inside the token loop, since a tool
runs on the host. The price: each later turn prefills every row of the batch again at its whole context's length
(inactive rows one token), where one decode would extend the caches, and compiles its programs per prompt bucket
and per power of two of the tokens left. `respond` must be deterministic: on several processes sampling the same
rows (evaluation), each decides the turns on its own.
"""

import ast
import dataclasses
import operator
import re
from typing import ClassVar, Protocol

import jax
import numpy as np
from jax.experimental import multihost_utils

from maxtext_posttrain import config as config_lib
from maxtext_posttrain import user_code
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
  _open_call: ClassVar[re.Pattern] = re.compile(r"<<([^<>]*)=$")

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
_EXCERPT_CHARS = 200


class ToolError(RuntimeError):
  """A tool's `respond` raised (under `rl.tool_on_error=raise`): the run stops naming the tool, the row and the
  completion it was given."""


def load(spec: str) -> Tool:
  """The tool `spec` names: a built-in (BUILTINS) or `package.module:name`, a Tool or a class made with no
  arguments; ConfigError naming the spec otherwise."""
  if spec in BUILTINS:
    return BUILTINS[spec]()
  try:
    found = user_code.resolve(spec, f"one of {sorted(BUILTINS)} or 'package.module:name'")
  except user_code.NotFound as error:
    raise config_lib.ConfigError(f"rl.tools: tool {spec!r}: {error}.") from error
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


def stop_tokens(tools: list[Tool], encoder: pipeline.Encoder) -> dict[int, Tool]:
  """Each tool by its stop token; ConfigError when two tools' calls end with one token, or one's with EOS."""
  stops = {}
  for tool in tools:
    token = stop_id(tool, encoder)
    if token in stops or token == encoder.tokenizer.eos_id:
      other = stops[token].name if token in stops else "EOS"
      raise config_lib.ConfigError(f"rl.tools: {tool.name}'s calls end with the token {other}'s end with ({token}).")
    stops[token] = tool
  return stops


def followup_config(config):
  """The config of the sampler of later turns: a prefill that covers a prompt and a completion so far (up to
  max_target_length tokens), the same generation budget."""
  budget = config_lib.max_new_tokens(config)
  return config_lib.with_overrides(config, max_prefill_predict_length=config.max_prefill_predict_length + budget)


def with_tools(sampler: sampler_lib.Sampler, config, encoder: pipeline.Encoder) -> "sampler_lib.Sampler | ToolUse":
  """`sampler`, or with `rl.tools` set, sampling in turns with those tools through it."""
  if not config.rl.tools:
    return sampler
  tools = [load(spec) for spec in config.rl.tools]
  return ToolUse(sampler, tools, encoder, config.rl.max_tool_calls, config.rl.tool_on_error)


class ToolUse:
  """Sampling with tools in turns (module docstring), on the rollout sampler's mesh."""

  def __init__(
      self,
      sampler: sampler_lib.Sampler,
      tools: list[Tool],
      encoder: pipeline.Encoder,
      max_calls: int,
      on_error: str = "raise",
  ):
    self.sampler = sampler
    self.encoder = encoder
    self.max_calls = max_calls
    self.on_error = on_error  # rl.tool_on_error
    self.stops = stop_tokens(tools, encoder)
    self.budget = config_lib.max_new_tokens(sampler.config)
    self.followup = sampler_lib.Sampler(followup_config(sampler.config), sampler.mesh)

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
    if max_new_tokens > self.budget:
      raise ValueError(
          f"max_new_tokens={max_new_tokens} is more than the generation budget the later turns are sized for "
          f"(max_target_length - max_prefill_predict_length = {self.budget})."
      )
    params = self.sampler.on_mesh(params, copy=copy_params)  # later turns read the weights the first one did
    first = self.sampler.start(
        params,
        prompts,
        max_new_tokens,
        eos_id,
        rng,
        sampling,
        num_samples=num_samples,
        stop_ids=tuple(self.stops) if self.max_calls else (),
        process_local=process_local,
    )
    return PendingToolRollouts(self, first, params, max_new_tokens, eos_id, rng, sampling, process_local)


@dataclasses.dataclass
class PendingToolRollouts:
  """The first turn's dispatched program and what the later turns need; `result()` runs them (once)."""

  tool_use: ToolUse
  first: sampler_lib.PendingRollouts
  params: object
  max_new_tokens: int
  eos_id: int
  rng: jax.Array
  sampling: sampler_lib.SamplingParams
  process_local: bool
  _result: sampler_lib.Rollouts | None = None

  def result(self) -> sampler_lib.Rollouts:
    """Waits for the first turn, then answers calls and decodes again until every row is done."""
    if self._result is None:
      self._result, self.params = self._finish(), None  # the weights' copy is not needed any more
    return self._result

  def _finish(self) -> sampler_lib.Rollouts:
    use, budget = self.tool_use, self.max_new_tokens
    out = self.first.result()
    rows = len(out.lengths)
    tokens = [out.tokens[r, : out.lengths[r]].tolist() for r in range(rows)]
    logprobs = [out.logprobs[r, : out.lengths[r]].tolist() for r in range(rows)]
    sampled = [[1] * len(t) for t in tokens]
    # Per row: turns ended at a stop token; calls answered; calls whose tool raised (rl.tool_on_error=skip).
    stops, calls, errors = (np.zeros(rows, np.int32) for _ in range(3))
    turn_keys = jax.random.split(self.rng)[1]
    stopping = use.max_calls > 0  # whether the turn just decoded stopped at the tools' stop tokens
    for turn in range(1, use.max_calls + 2):
      active = [stopping and self._answer(r, tokens, logprobs, sampled, stops, calls, errors) for r in range(rows)]
      # The most tokens a row has left, and whether some row may still have a call answered (then the turn stops at
      # the tools' tokens; else it samples to the end), over every process.
      left, stopping = self._gathered_max(
          max((budget - len(tokens[r]) for r in range(rows) if active[r]), default=0),
          int(any(active[r] and stops[r] < use.max_calls for r in range(rows))),
      )
      if not left:
        break
      more = use.followup.sample(
          self.params,
          [out.prompts[r] + tokens[r] if active[r] else [self.eos_id] for r in range(rows)],
          min(budget, 1 << (left - 1).bit_length()),  # a power of two: a few programs for every budget left
          self.eos_id,
          jax.random.fold_in(turn_keys, turn),
          self.sampling,
          stop_ids=tuple(use.stops) if stopping else (),
          truncate_prompts=False,
          process_local=self.process_local,
          active=active,
      )
      for r in np.flatnonzero(active):
        n = min(int(more.lengths[r]), budget - len(tokens[r]))
        tokens[r] += more.tokens[r, :n].tolist()
        logprobs[r] += more.logprobs[r, :n].tolist()
        sampled[r] += [1] * n
    grid = lambda values, dtype: np.array([v + [0] * (budget - len(v)) for v in values], dtype).reshape(rows, budget)
    return sampler_lib.Rollouts(
        prompts=out.prompts,
        tokens=grid(tokens, np.int32),
        logprobs=grid(logprobs, np.float32),
        lengths=np.array([len(t) for t in tokens], np.int32),
        finish_reasons=["eos" if t and t[-1] == self.eos_id else "length" for t in tokens],
        num_truncated_prompts=out.num_truncated_prompts,
        num_samples=out.num_samples,
        sampled=grid(sampled, np.int8),
        tool_calls=calls,
        tool_errors=errors,
    )

  def _answer(
      self,
      r: int,
      tokens: list[list[int]],
      logprobs: list[list[float]],
      sampled: list[list[int]],
      stops: np.ndarray,
      calls: np.ndarray,
      errors: np.ndarray,
  ) -> bool:
    """Counts row r's stop if it ended its turn at a tool's stop token and appends the tool's answer (none past
    rl.max_tool_calls stops); whether the row decodes again (it stopped there with budget left)."""
    use, budget = self.tool_use, self.max_new_tokens
    if not tokens[r] or tokens[r][-1] not in use.stops or len(tokens[r]) >= budget:
      return False
    stops[r] += 1
    if stops[r] > use.max_calls:
      return True
    tool = use.stops[tokens[r][-1]]
    text = use.encoder.decode_completion(tokens[r])
    try:
      answer = tool.respond(text)
    except Exception as error:  # a user's tool: any failure stops the run, naming it, or is counted
      if use.on_error == "skip":
        answer, errors[r] = None, errors[r] + 1
      else:
        excerpt = text if len(text) <= _EXCERPT_CHARS else "... " + text[-_EXCERPT_CHARS:]
        raise ToolError(
            f"Tool {tool.name!r} on row {r}: {type(error).__name__}: {error}; completion: {excerpt!r} "
            "(rl.tool_on_error=skip leaves such calls unanswered and counts them)"
        ) from error
    if answer is not None:
      ids = answer_ids(use.encoder, tool, answer)[: budget - len(tokens[r])]
      tokens[r] += ids
      logprobs[r] += [0.0] * len(ids)
      sampled[r] += [0] * len(ids)
      calls[r] += 1
    return len(tokens[r]) < budget

  def _gathered_max(self, *values: int) -> tuple[int, ...]:
    """The largest of each of `values` over the processes, in one gather: a turn is a collective program when rows are
    process-local, so every process decides on the same figures."""
    if not self.process_local:
      return values
    gathered = np.asarray(multihost_utils.process_allgather(np.array(values, np.int32))).reshape(-1, len(values))
    return tuple(int(x) for x in gathered.max(axis=0))
