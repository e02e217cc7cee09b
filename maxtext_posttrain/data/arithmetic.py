"""Procedurally generated arithmetic word problems in GSM8K answer format.

A bundled, offline data set lets a tiny model learn something measurable (answer accuracy) in minutes on a CPU, with
no download. Answers are short worked solutions ending in `#### <number>`, exactly like GSM8K, so the same answer
extraction and scoring serve both. Preference pairs for DPO and its relatives reuse
the same problems: the chosen answer is the worked solution, the rejected one a plausible wrong solution (an
arithmetic slip, a swapped operation or a miscopied final answer). Generation is deterministic in (difficulty,
split, seed); a question belongs to the test split only if its text hashes into the test bucket, so no test question can ever appear in train, whatever the
sizes and seeds.
"""

import dataclasses
import hashlib
import random
import re

SPLITS = ("train", "test")
_TEST_BUCKETS = 10  # one in ten possible questions is reserved for test


@dataclasses.dataclass(frozen=True)
class Difficulty:
  """How a problem is drawn: number of steps, operations and operand range."""

  min_steps: int
  max_steps: int
  ops: tuple[str, ...]
  max_operand: int
  max_factor: int = 9  # multipliers stay small so answers stay short, as in real word problems
  required_op: str | None = None


DIFFICULTIES = {
    "easy": Difficulty(min_steps=1, max_steps=1, ops=("+", "-"), max_operand=9),
    "medium": Difficulty(min_steps=2, max_steps=2, ops=("+", "-"), max_operand=20),
    "hard": Difficulty(min_steps=2, max_steps=3, ops=("+", "-", "*"), max_operand=50, required_op="*"),
}

_NAMES = (
    "Tom", "Anna", "Ben", "Maria", "Leo", "Sara", "Omar", "Mia", "Ravi", "Lena",
    "Jack", "Nora", "Ivan", "Zoe", "Kenji", "Ella", "Pablo", "Ada", "Sam", "Priya",
)  # fmt: skip
_OBJECTS = (
    "apples", "marbles", "stickers", "books", "pencils", "cookies", "coins", "stamps",
    "shells", "cards", "balloons", "oranges", "toy cars", "beads", "flowers",
)  # fmt: skip
_OPENINGS = (
    "{name} has {n} {obj}.",
    "{name} starts the day with {n} {obj}.",
    "{name} keeps {n} {obj} in a box.",
    "At first, {name} owns {n} {obj}.",
)
_STEPS = {
    "+": (
        "{name} buys {n} more.",
        "{name} finds {n} more {obj}.",
        "{name} gets {n} more {obj} from a friend.",
        "{name} picks up another {n} {obj}.",
    ),
    "-": (
        "{name} gives away {n} of them.",
        "{name} sells {n} {obj}.",
        "{name} loses {n} {obj}.",
        "{name} uses {n} of them.",
    ),
    "*": (
        "{name} then ends up with {n} times as many {obj}.",
        "The number of {obj} {name} has grows to {n} times as many.",
    ),
}
_CONNECTORS = ("", "Then ", "After that, ", "Later, ")
_QUESTIONS = (
    "How many {obj} does {name} have now?",
    "How many {obj} does {name} have in the end?",
)


def split_of(question: str) -> str:
  """The split a question belongs to, fixed by its text so train and test can never share a question."""
  bucket = int.from_bytes(hashlib.sha256(question.encode("utf-8")).digest()[:8], "big") % _TEST_BUCKETS
  return "test" if bucket == 0 else "train"


def _draw_ops(rng: random.Random, level: Difficulty) -> list[str]:
  ops = [rng.choice(level.ops) for _ in range(rng.randint(level.min_steps, level.max_steps))]
  if level.required_op and level.required_op not in ops:
    ops[rng.randrange(len(ops))] = level.required_op
  return ops


def _draw_operand(rng: random.Random, level: Difficulty, op: str, total: int) -> int:
  """An operand that keeps every intermediate count non-negative."""
  if op == "*":
    return rng.randint(2, level.max_factor)
  if op == "-":
    return rng.randint(1, min(total, level.max_operand)) if total > 0 else 0
  return rng.randint(1, level.max_operand)


def _apply(op: str, a: int, b: int) -> int:
  return {"+": a + b, "-": a - b, "*": a * b}[op]


def _step_sentence(rng: random.Random, index: int, op: str, **slots) -> str:
  sentence = rng.choice(_STEPS[op]).format(**slots)
  connector = rng.choice(_CONNECTORS) if index else ""
  if connector and sentence.startswith("The "):
    sentence = "the " + sentence[len("The ") :]
  return connector + sentence


def _draw_problem(rng: random.Random, level: Difficulty, calculator: bool) -> dict[str, str]:
  """One problem: question text and a worked solution ending in `#### <answer>`, each step written with GSM8K's
  calculator annotation (`28 * 9 = <<28*9=252>>252`) when `calculator`."""
  name, obj = rng.choice(_NAMES), rng.choice(_OBJECTS)
  total = rng.randint(1, level.max_operand)
  sentences = [rng.choice(_OPENINGS).format(name=name, n=total, obj=obj)]
  lines = []
  for index, op in enumerate(_draw_ops(rng, level)):
    operand = _draw_operand(rng, level, op, total)
    result = _apply(op, total, operand)
    sentences.append(_step_sentence(rng, index, op, name=name, n=operand, obj=obj))
    annotation = f"<<{total}{op}{operand}={result}>>" if calculator else ""
    lines.append(f"{total} {op} {operand} = {annotation}{result}")
    total = result
  sentences.append(rng.choice(_QUESTIONS).format(name=name, obj=obj))
  return {"question": " ".join(sentences), "answer": "\n".join(lines + [f"#### {total}"])}


def generate(difficulty: str, split: str, num_examples: int, seed: int, calculator: bool = False) -> list[dict[str, str]]:
  """`num_examples` distinct problems of `split`, deterministic in (difficulty, split, seed); with `calculator`, the
  same problems with their steps annotated for GSM8K's calculator (`rollout.tools.Calculator`)."""
  if difficulty not in DIFFICULTIES:
    raise ValueError(f"Unknown difficulty {difficulty!r}; expected one of {sorted(DIFFICULTIES)}.")
  if split not in SPLITS:
    raise ValueError(f"Unknown split {split!r}; expected one of {SPLITS}.")
  level = DIFFICULTIES[difficulty]
  rng = random.Random(f"arithmetic/{difficulty}/{split}/{seed}")  # str seeds are stable across processes
  examples, seen = [], set()
  max_draws = 100 * num_examples + 1000
  for _ in range(max_draws):
    if len(examples) == num_examples:
      return examples
    problem = _draw_problem(rng, level, calculator)
    if problem["question"] not in seen and split_of(problem["question"]) == split:
      seen.add(problem["question"])
      examples.append(problem)
  if len(examples) == num_examples:
    return examples
  raise ValueError(
      f"Could only draw {len(examples)} distinct {difficulty!r} {split} problems of the {num_examples} asked for."
  )


_STEP_LINE = re.compile(r"^(-?\d+) ([-+*]) (\d+) = (-?\d+)$")
_SWAPPED = {"+": "-", "-": "+", "*": "+"}


def _worked(start: int, steps: list[tuple[str, int]], final: int | None = None) -> str:
  lines, total = [], start
  for op, operand in steps:
    result = _apply(op, total, operand)
    lines.append(f"{total} {op} {operand} = {result}")
    total = result
  return "\n".join(lines + [f"#### {total if final is None else final}"])


def wrong_answer(answer: str, rng: random.Random) -> str:
  """A plausible wrong worked solution for `answer`: one step's result slips by 1 to 3 (later steps carry the slip
  on), one step's operation is swapped, or the steps are right and the final line miscopies the result. Its final
  answer always differs from the correct one and stays non-negative."""
  *step_lines, final_line = answer.split("\n")
  parsed = [_STEP_LINE.match(line) for line in step_lines]
  if not step_lines or not all(parsed) or not final_line.startswith("#### "):
    raise ValueError(f"Not a worked arithmetic answer: {answer!r}")
  start = int(parsed[0].group(1))
  steps = [(m.group(2), int(m.group(3))) for m in parsed]
  correct = int(final_line[len("#### ") :])
  kind = rng.choice(("slip", "swap", "miscopy"))
  if kind == "swap":
    k = rng.randrange(len(steps))
    swapped = steps[:k] + [(_SWAPPED[steps[k][0]], steps[k][1])] + steps[k + 1 :]
    wrong = _worked(start, swapped)
    final = int(wrong.rpartition("#### ")[2])
    if final != correct and final >= 0 and all(int(m) >= 0 for m in re.findall(r"-?\d+", wrong)):
      return wrong
    kind = "slip"  # the swap cancelled out or went negative
  delta = rng.randint(1, 3) * (1 if correct < 3 or rng.random() < 0.5 else -1)
  if kind == "miscopy":
    return _worked(start, steps, final=correct + delta)
  # A slip in the first step's result, carried through the remaining steps.
  first_op, first_operand = steps[0]
  slipped = _apply(first_op, start, first_operand) + delta
  if slipped < 0:
    slipped = _apply(first_op, start, first_operand) + abs(delta)
  rest = _worked(slipped, steps[1:]).split("\n")
  wrong = "\n".join([f"{start} {first_op} {first_operand} = {slipped}"] + rest)
  if int(wrong.rpartition("#### ")[2]) == correct or any(int(m) < 0 for m in re.findall(r"-?\d+", wrong)):
    return _worked(start, steps, final=correct + abs(delta))
  return wrong


def generate_preferences(difficulty: str, split: str, num_examples: int, seed: int) -> list[dict[str, str]]:
  """`generate(...)`'s problems as preference pairs: `question`, `chosen` (the worked solution) and `rejected`."""
  rng = random.Random(f"arithmetic-preferences/{difficulty}/{split}/{seed}")
  return [
      {"question": p["question"], "chosen": p["answer"], "rejected": wrong_answer(p["answer"], rng)}
      for p in generate(difficulty, split, num_examples, seed)
  ]
