"""Pure loss functions over arrays (logits, targets, masks, advantages), free of models, configs and sharding."""
