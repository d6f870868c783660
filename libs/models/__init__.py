"""Self-generated tiny models (:mod:`libs.models.tiny`) and the codec decoder runtime
(:mod:`libs.models.codec`). Import the module you need: the package imports nothing, so resolving
a model's directory loads neither torch nor transformers."""
