"""Rule-based rewards for math word problems in GSM8K form (a worked solution whose last line is `#### <number>`).

RL scores every rollout of every step, so the common case must be cheap: final answers are almost always plain
numbers, which are compared as exact `Fraction`s once commas, `$`, `%`, a leading `+`, trailing zeros and a typed
minus (U+2212 or an en dash) are normalised away. Only answers that are not plain numbers (LaTeX such as
`\\frac{3}{4}` or `\\boxed{7}`, a number with words around it) go to math-verify, which parses with sympy and costs
milliseconds instead of microseconds.

Checking is as strict as a grader where math-verify alone would be lenient: an answer that hedges between numbers
(`18 or 19`) scores 0, though math-verify would read its last one, and a whole-number reference is matched exactly.

The rewards follow the contract of `maxtext_posttrain.rewards`. `correctness` and `partial` also take a keyword
`pattern` (see `extract_final_answer`) for models that state answers another way, e.g.
`functools.partial(correctness, pattern=r"\\\\boxed\\{(.+?)\\}")` in a user reward module.
"""

import fractions
import re
import threading

import math_verify

MARKER = "####"
REL_TOL = fractions.Fraction(1, 10**6)  # see numbers_equal
_TIMEOUT_S = 5  # math-verify's own default, per parse and per comparison
# Longer answers are not final answers but runaway generations; they are never sent to sympy, which can take
# seconds on them and has no timeout off the main thread.
_MAX_FALLBACK_CHARS = 256
_THOUSANDS_COMMA = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")
# The minus sign and the en dash, which people type for `-`; read as `-` anywhere, as a dash between words reads the
# same either way.
_MINUS_SIGNS = str.maketrans("\u2212\u2013", "--")
# LaTeX math that math-verify takes the answer from; `\boxed{}` with up to two levels of braces inside.
_LATEX_MATH = re.compile(r"\$[^$]*\$|\\\(.*?\\\)|\\\[.*?\\\]|\\boxed\{(?:[^{}]|\{(?:[^{}]|\{[^{}]*\})*\})*\}")
# After normalisation: sign, digits with optional decimals and a small exponent, optionally `/` a denominator.
_PLAIN_NUMBER = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d{1,3})?(?:/\d+)?")
# A plain number in running text (so `a/b` is one number); digits glued after a letter or `^` are part of a unit
# (`m2`, `m^2`), not a number.
_NUMBER = re.compile(r"(?<![A-Za-z^])" + _PLAIN_NUMBER.pattern)
# A well-formed final line: on its own line, `####`, a number as GSM8K writes it, nothing but whitespace after.
_FINAL_LINE = re.compile(r"(?:\A|\n)[ \t]*####[ \t]*-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?\s*\Z")


def extract_final_answer(text: str, pattern: str | None = None) -> str | None:
  """The final answer stated in `text`, stripped; None if there is none.

  By default it is the first non-blank line after the last `####` (GSM8K): only that line, because a model that
  does not stop often writes on after its answer. A regex `pattern` with one group overrides this: the answer is
  that group of its last match, e.g. r"\\\\boxed\\{(.+?)\\}" or r"The answer is (.+)".
  """
  if pattern is None:
    _, marker, tail = text.rpartition(MARKER)
    answer = tail.strip().split("\n", 1)[0] if marker else ""
  else:
    regex = re.compile(pattern)
    if regex.groups != 1:
      raise ValueError(f"Answer pattern {pattern!r} has {regex.groups} groups; it needs exactly one.")
    matches = regex.findall(text)
    answer = matches[-1] if matches else ""
  return answer.strip() or None


def _normalise(text: str) -> str:
  """`text` with typed minus signs as `-`, and without `$` signs and thousands commas, which are not numbers."""
  return _THOUSANDS_COMMA.sub("", text.translate(_MINUS_SIGNS).replace("$", ""))


def parse_number(text: str) -> fractions.Fraction | None:
  """`text` as an exact number if it is a plain one, else None.

  Surrounding whitespace, a trailing full stop, `$` signs, a trailing `%` (GSM8K answers "25%" as 25), thousands
  commas and a leading `+` are dropped; U+2212 and the en dash are minus signs; `a/b` is a fraction.
  """
  text = _normalise(text).strip().removesuffix(".").removesuffix("%").rstrip()
  if not _PLAIN_NUMBER.fullmatch(text):
    return None
  numerator, _, denominator = text.partition("/")
  try:
    return fractions.Fraction(numerator) / fractions.Fraction(denominator or 1)
  except (ValueError, ZeroDivisionError):  # x/0, or more digits than Python converts
    return None


def numbers_equal(predicted: fractions.Fraction, gold: fractions.Fraction) -> bool:
  """Exactly equal where `gold` is a whole number, else within REL_TOL of it (a rounded 1/3). A whole gold is exact
  because at GSM8K scale a relative tolerance would accept 1,450,000.5 or 1,450,001 for 1,450,000."""
  if gold.denominator == 1:
    return predicted == gold
  return abs(predicted - gold) <= REL_TOL * abs(gold)


def _timeout_s() -> int | None:
  """math-verify times out with SIGALRM, which only the main thread may set (elsewhere its parse raises): off the
  main thread it runs without a timeout, bounded by _MAX_FALLBACK_CHARS."""
  return _TIMEOUT_S if threading.current_thread() is threading.main_thread() else None


def _hedged(answer: str) -> bool:
  """Whether `answer` states several answers (`18 or 19`, `18, 19`, `17-18`, `3 + 15 = 18`), where math-verify would
  read only its last number, or its `\\boxed{}` one (`\\boxed{18} or 19`), and a policy would learn to hedge.

  Plain text hedges when it has more than one distinct number. LaTeX hedges when it has digits outside its math
  (`$...$`, `\\(...\\)`, `\\[...\\]`, `\\boxed{}`); bare LaTeX (`2\\sqrt{2}`) is all math, and math-verify reads
  several answers in math (`18 \\text{ or } 19`) as a set, equal to no number.
  """
  if "\\" in answer:
    outside = _LATEX_MATH.sub(" ", answer)
    return outside != answer and re.search(r"\d", outside) is not None
  return len({parse_number(number) for number in _NUMBER.findall(_normalise(answer))}) > 1


def _as_latex(answer: str) -> str:
  """Bare LaTeX (`2\\sqrt{2}`) in `$...$`, so math-verify reads all of it rather than the first number it finds."""
  return f"${answer}$" if "\\" in answer and "$" not in answer else answer


def answers_equal(predicted: str, gold: str) -> bool:
  """Whether a predicted final answer is the gold one: as plain numbers (see numbers_equal) if both are, else by
  math-verify unless the prediction hedges (see _hedged)."""
  predicted_number, gold_number = parse_number(predicted), parse_number(gold)
  if predicted_number is not None and gold_number is not None:
    return numbers_equal(predicted_number, gold_number)
  if max(len(predicted), len(gold)) > _MAX_FALLBACK_CHARS or _hedged(predicted):
    return False
  timeout_s = _timeout_s()
  parsed_gold = math_verify.parse(_as_latex(gold.translate(_MINUS_SIGNS)), parsing_timeout=timeout_s)
  parsed_predicted = math_verify.parse(_as_latex(predicted.translate(_MINUS_SIGNS)), parsing_timeout=timeout_s)
  return math_verify.verify(parsed_gold, parsed_predicted, timeout_seconds=timeout_s)


def gold_answer(answer: str) -> str:
  """The reference's final answer: after its `####` if it has one (a GSM8K solution), else all of it."""
  gold = extract_final_answer(answer) if MARKER in answer else answer.strip()
  if not gold:
    raise ValueError(f"Reference answer states no final answer: {answer[-100:]!r}")
  return gold


def _score(completion: str, answer: str, pattern: str | None, partial_credit: bool) -> float:
  predicted, gold = extract_final_answer(completion, pattern), gold_answer(answer)
  if predicted is None:
    return 0.0
  if answers_equal(predicted, gold):
    return 1.0
  if not partial_credit:
    return 0.0
  predicted_number, gold_number = parse_number(predicted), parse_number(gold)
  if predicted_number is None or gold_number is None:
    return 0.0
  tolerance = abs(gold_number) / 10 if gold_number else fractions.Fraction(1, 2)
  return 0.5 if abs(predicted_number - gold_number) <= tolerance else 0.0


def correctness(
    prompts: list[str], completions: list[str], answers: list[str], *, pattern: str | None = None
) -> list[float]:
  """1.0 where the completion's final answer equals the reference's (see `answers_equal`), else 0.0; a completion
  that states no final answer scores 0."""
  del prompts  # the answer alone decides
  return [_score(completion, answer, pattern, False) for completion, answer in zip(completions, answers, strict=True)]


def partial(prompts: list[str], completions: list[str], answers: list[str], *, pattern: str | None = None) -> list[float]:
  """`correctness` with half credit for near misses: 1.0 if correct; 0.5 if both final answers are plain numbers
  and the prediction is within 10% of |gold| (within 0.5 when gold is 0); else 0.0."""
  del prompts  # the answer alone decides
  return [_score(completion, answer, pattern, True) for completion, answer in zip(completions, answers, strict=True)]


# pylint: disable-next=redefined-builtin
def format(prompts: list[str], completions: list[str], answers: list[str]) -> list[float]:
  """1.0 where the completion ends in one well-formed GSM8K final line, else 0.0.

  Well-formed: the completion has exactly one `####`; it starts the last non-blank line (after optional spaces) and
  is followed by a number as GSM8K writes it (optional `-`, digits with optional thousands commas, optional
  decimals), then only whitespace to the end. No `$`, `%`, units, fractions or LaTeX: those may still be correct,
  but the format asks for the plain number.
  """
  del prompts, answers  # the completion alone decides
  return [float(completion.count(MARKER) == 1 and bool(_FINAL_LINE.search(completion))) for completion in completions]
