"""Personally identifiable information (PII): find it in a model's responses, remove it from training data.

Built on Microsoft Presidio (`presidio-analyzer`, `presidio-anonymizer`; the package's `[safety]` extra). Its
recognizers find e-mail addresses, phone numbers, credit cards, IBANs, IP and MAC addresses, URLs, crypto wallets,
US SSNs and ITINs and more by pattern and checksum, and score each finding; context words ("call", "phone") raise a
score. Names, places and organisations need a named-entity model: `spacy_model` names an installed spaCy pipeline
(e.g. `en_core_web_lg`, from `python -m spacy download en_core_web_lg`). Without one (the default: no model ships
with the package and nothing is downloaded at run time) the detector runs Presidio's pattern recognizers on a blank
English tokenizer and says which entities it can find. A blank tokenizer has no lemmas, so context words cannot
raise a score: a phone number matched by pattern alone scores 0.4, which is why `safety.pii_score_threshold`
defaults to 0.4 (Presidio's analyzer defaults to 0, every finding). The US passport, bank-number and driver's-licence
recognizers stay listed, but their patterns score 0.05-0.3 without context, so at the default threshold they find
nothing without a spaCy pipeline.

Presidio's e-mail and URL recognizers check domains with `tldextract`, which would fetch the public suffix list from
the internet on first use; this module sets `TLDEXTRACT_PUBLIC_SUFFIX_LIST_URLS` to empty (unless the environment
sets it) so tldextract uses the snapshot it ships, on machines without internet as on those with it.
"""

import collections
import dataclasses
import logging
import os
import tempfile
from typing import Sequence

from maxtext_posttrain import cli
from maxtext_posttrain import config as config_lib

os.environ.setdefault("TLDEXTRACT_PUBLIC_SUFFIX_LIST_URLS", "")  # before presidio imports tldextract

# pylint: disable=wrong-import-position
try:
  import spacy
  from presidio_analyzer import AnalyzerEngine
  from presidio_analyzer import RecognizerRegistry
  from presidio_analyzer.nlp_engine import SpacyNlpEngine
  from presidio_analyzer.predefined_recognizers import SpacyRecognizer
  from presidio_anonymizer import AnonymizerEngine
except ImportError as e:
  raise cli.Failure(f"PII detection needs Presidio: pip install 'maxtext_posttrain[safety]' ({e}).") from e


# Found by pattern in ordinary text (dates in word problems, timetables, histories); listed in `entities`, they count.
NOT_BY_DEFAULT = ("DATE_TIME",)


@dataclasses.dataclass(frozen=True)
class Finding:
  entity: str
  start: int
  end: int
  score: float
  text: str


class PiiDetector:
  """Finds PII entities in English text, and replaces them with `<ENTITY_TYPE>` placeholders."""

  def __init__(self, entities: Sequence[str], score_threshold: float, spacy_model: str):
    if spacy_model and not (spacy.util.is_package(spacy_model) or os.path.isdir(os.path.expanduser(spacy_model))):
      raise config_lib.ConfigError(
          f"safety.pii_spacy_model={spacy_model!r} is neither an installed spaCy pipeline nor a directory; install "
          f"it (python -m spacy download {spacy_model}) or leave the key empty for the pattern recognizers alone."
      )
    with tempfile.TemporaryDirectory() as blank:
      if not spacy_model:
        spacy.blank("en").to_disk(blank)  # a tokenizer only: no named entities, nothing to download
      nlp_engine = SpacyNlpEngine(models=[{"lang_code": "en", "model_name": os.path.expanduser(spacy_model) or blank}])
      try:
        nlp_engine.load()
      except OSError as e:  # a directory that holds no spaCy pipeline
        raise config_lib.ConfigError(f"safety.pii_spacy_model={spacy_model!r}: {e}") from e
    registry = RecognizerRegistry()
    presidio_log = logging.getLogger("presidio-analyzer")
    level = presidio_log.level
    presidio_log.setLevel(logging.ERROR)  # a warning per recognizer of another language, on every build
    try:
      registry.load_predefined_recognizers(languages=["en"], nlp_engine=nlp_engine)
    finally:
      presidio_log.setLevel(level)
    self.analyzer = AnalyzerEngine(nlp_engine=nlp_engine, registry=registry, supported_languages=["en"])
    self.anonymizer = AnonymizerEngine()
    recognizers = registry.get_recognizers(language="en", all_fields=True)
    known = {e for r in recognizers for e in r.supported_entities}
    detectable = {
        e for r in recognizers if spacy_model or not isinstance(r, SpacyRecognizer) for e in r.supported_entities
    }
    unknown = sorted(set(entities) - known)
    if unknown:
      raise config_lib.ConfigError(
          f"safety.pii_entities: unknown entity types {unknown}; detectable: {sorted(detectable)}."
      )
    needs_model = sorted(set(entities) - detectable)
    if needs_model:
      raise config_lib.ConfigError(
          f"safety.pii_entities: {needs_model} need a named-entity model (safety.pii_spacy_model); detectable without "
          f"one: {sorted(detectable)}."
      )
    self.entities = sorted(entities or detectable - set(NOT_BY_DEFAULT))
    self.score_threshold = score_threshold

  def _results(self, text: str) -> list:
    """Presidio's findings scoring at least `score_threshold`, less each one overlapping a finding that scores at
    least as high (the URL recognizer matches the domain of an e-mail address), by position."""
    results = self.analyzer.analyze(
        text=text, language="en", entities=self.entities, score_threshold=self.score_threshold
    )
    kept = []
    for r in sorted(results, key=lambda r: (-r.score, r.start - r.end)):  # best first; of equal scores, the longest
      if not any(r.start < k.end and k.start < r.end for k in kept):
        kept.append(r)
    return sorted(kept, key=lambda r: r.start)

  def find(self, text: str) -> list[Finding]:
    """The PII in `text` (see `_results`)."""
    return [Finding(r.entity_type, r.start, r.end, float(r.score), text[r.start : r.end]) for r in self._results(text)]

  def redact(self, text: str) -> tuple[str, collections.Counter]:
    """`text` with each span `find` reports replaced by `<ENTITY_TYPE>` (Presidio's anonymizer, which merges adjacent
    spans of one type into one placeholder), and the placeholders written by entity type."""
    results = self._results(text)
    if not results:
      return text, collections.Counter()
    redacted = self.anonymizer.anonymize(text=text, analyzer_results=results)
    return redacted.text, collections.Counter(item.entity_type for item in redacted.items)


def from_config(config) -> PiiDetector:
  section = config_lib.safety(config)
  return PiiDetector(section.pii_entities, section.pii_score_threshold, section.pii_spacy_model)
