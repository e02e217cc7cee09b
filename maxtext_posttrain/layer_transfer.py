"""Feature and attention transfer between matched student and teacher layers, for `posttrain_mode=distill`.

MaxText's keys keep their meaning: `distill_beta` weighs the feature loss (`distill_feature_loss_type` cosine or
l2) on the attention out-projection activations that MaxText sows when distill_beta > 0 (or, with
`distill.feature_source=hidden`, on the decoder layers' outputs, FitNets' and TinyBERT's hidden states), at the
layers `distill_layer_indices` (all layers when unset); `distill_beta_end` / `distill_beta_schedule` anneal it. MaxText
takes the same indices in both models; `distill.teacher_layer_indices` names other teacher layers, in order, for a
teacher of another depth. `distill.attention_weight` adds attention transfer (MiniLM, TinyBERT) between the same
layers' attention probabilities (`layer_capture`: MaxText's own softmax), with head counts averaged in groups when
they differ (`losses.distillation.attention_loss`). Features of different widths meet through a learned
[student emb, teacher emb] map (`distill.feature_projection=linear`, FitNets' regressor), or after mean pooling the
wider side in runs of (wider / narrower) units (`pool`, which needs one width to divide the other).

The learned map is a parameter of the student model, `distill_projection`, of its own variable type
(`FeatureProjection`, an `nnx.Param`): the optimizer trains it and checkpoints save and restore it with the student,
while what reads MaxText's weights leaves it out: decoding (`lora.policy_params`) and the start weights of
`load_parameters_path` (`roles.load_start_weights`, which starts it fresh).

Both terms are means over the matched layers of per-token means, the way MaxText averages its feature loss, and are
added to the logit loss: alpha T^2 D + (1 - alpha) CE + beta x feature + attention_weight x attention.
"""

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from maxtext_posttrain import config as config_lib
from maxtext_posttrain import layer_capture
from maxtext_posttrain.losses import distillation

BETA_KEY = "distill_beta"
PROJECTION = "distill_projection"


class FeatureProjection(nnx.Param):
  """The student's learned map of its features to the teacher's width: trained and checkpointed with the student,
  not one of MaxText's weights."""


def attach_projection(model: nnx.Module, config, width: int) -> nnx.Module:
  """`model` with a `distill_projection` kernel [emb_dim, width], LeCun-normal from `init_weights_seed` (so the
  student's output starts as a random projection of its features, as FitNets' regressor), sharded like the
  embedding dimension on its rows."""
  key = jax.random.fold_in(jax.random.key(config.init_weights_seed), 1)
  kernel = nnx.initializers.lecun_normal()(key, (config.emb_dim, width), config.weight_dtype)
  setattr(model, PROJECTION, FeatureProjection(kernel, sharding=("embed", None)))
  return model


def has_projection(tree) -> bool:
  """Whether a model or a params tree (a checkpoint's) carries the learned map."""
  return hasattr(tree, PROJECTION) if isinstance(tree, nnx.Module) else PROJECTION in tree


@dataclasses.dataclass(frozen=True)
class LayerMap:
  """Student layer student[i] is matched to teacher layer teacher[i]."""

  student: tuple[int, ...]
  teacher: tuple[int, ...]


def enabled(config) -> bool:
  return config.distill_beta > 0 or config_lib.distill(config).attention_weight > 0


def _check_indices(key: str, indices, layers: int, model: str) -> tuple[int, ...]:
  bad = [i for i in indices if not 0 <= i < layers]
  if bad or not indices:
    raise ValueError(
        f"{key}={list(indices)}: the {model} has {layers} decoder layers; valid layer indices are 0..{layers - 1}."
    )
  return tuple(indices)


def layer_map(config, teacher_config) -> LayerMap:
  """The matched layers of the student (`config`) and the teacher, checked against both models' depths."""
  section = config_lib.distill(config)
  student_layers, teacher_layers = config.num_decoder_layers, teacher_config.num_decoder_layers
  student = config.distill_layer_indices
  if student is None:
    if section.teacher_layer_indices is not None or student_layers != teacher_layers:
      raise ValueError(
          f"distill_layer_indices is unset, which matches every layer, but the student has {student_layers} decoder "
          f"layers and the teacher {teacher_layers}: set distill_layer_indices (and distill.teacher_layer_indices)."
      )
    student = list(range(student_layers))
  student = _check_indices("distill_layer_indices", student, student_layers, "student")
  teacher = section.teacher_layer_indices if section.teacher_layer_indices is not None else list(student)
  key = "distill.teacher_layer_indices" if section.teacher_layer_indices is not None else "distill_layer_indices"
  teacher = _check_indices(key, teacher, teacher_layers, "teacher")
  if len(teacher) != len(student):
    raise ValueError(
        f"distill.teacher_layer_indices={list(teacher)} names {len(teacher)} teacher layers for the "
        f"{len(student)} student layers of distill_layer_indices={list(student)}."
    )
  if config.distill_beta > 0 and section.feature_projection == "pool":
    narrow, wide = sorted((config.emb_dim, teacher_config.emb_dim))
    if wide % narrow:
      raise ValueError(
          f"Feature transfer (distill_beta={config.distill_beta}) compares emb_dim {config.emb_dim} (student) with "
          f"{teacher_config.emb_dim} (teacher): distill.feature_projection=pool needs one width to divide the "
          "other; distill.feature_projection=linear learns a map."
      )
  return LayerMap(student, teacher)


def _pool(features: jax.Array, width: int) -> jax.Array:
  """[..., D] -> [..., width], the mean of each run of D / width consecutive units."""
  depth = features.shape[-1]
  return features if depth == width else jnp.mean(features.reshape(*features.shape[:-1], width, depth // width), -1)


def transfer_losses(
    config,
    layers: LayerMap,
    model: nnx.Module,
    student: layer_capture.Captures,
    teacher: layer_capture.Captures,
    mask: jax.Array,
) -> dict[str, distillation.DistillationLoss]:
  """{"feature": ..., "attention": ...} (the enabled ones) over `mask` [B, T], each total a sum over tokens of the
  mean over matched layers, so total / weight is MaxText's mean; `model` is the student (its learned map, if any)."""
  terms = {}
  count = len(layers.student)
  if config.distill_beta > 0:
    source = "hidden" if config_lib.distill(config).feature_source == "hidden" else "features"
    s = getattr(student, source)[jnp.array(layers.student)]
    t = getattr(teacher, source)[jnp.array(layers.teacher)]
    if has_projection(model):
      s = jnp.einsum("...d,de->...e", s, getattr(model, PROJECTION).get_value().astype(s.dtype))
    width = min(s.shape[-1], t.shape[-1])
    loss = distillation.feature_loss(_pool(s, width), _pool(t, width), mask, config.distill_feature_loss_type)
    terms["feature"] = distillation.DistillationLoss(total=loss.total / count, weight=loss.weight / count, metrics={})
  section = config_lib.distill(config)
  if section.attention_weight > 0:
    per_layer = [
        distillation.attention_loss(student.attention[i], teacher.attention[j], mask, section.attention_loss)
        for i, j in zip(layers.student, layers.teacher)
    ]
    total = sum(loss.total for loss in per_layer) / count
    terms["attention"] = distillation.DistillationLoss(total=total, weight=per_layer[0].weight, metrics={})
  return terms
