"""transformers and keras_hub models for ``dualframe plan``: GPT-2-medium-shaped (the issue's) and small ones to measure."""


def gpt2_medium():
    """GPT2LMHeadModel as GPT-2 medium: 24 blocks, width 1024, 354.8 M unique parameters (lm_head tied to wte)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(n_layer=24, n_embd=1024, n_head=16))


def gpt2_small_measured():
    """A small GPT2LMHeadModel whose real training step is measured (tests/core/plan/test_plan_hf.py)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=4, n_embd=256, n_head=4, vocab_size=4000, n_positions=256,
                        attn_implementation="eager", use_cache=False)
    return GPT2LMHeadModel(config)


def gpt2_backbone_medium():
    """keras_hub GPT2Backbone as GPT-2 medium (no head): 24 transformer layers, width 1024."""
    import keras_hub

    return keras_hub.models.GPT2Backbone(vocabulary_size=50257, num_layers=24, num_heads=16, hidden_dim=1024,
                                         intermediate_dim=4096, max_sequence_length=1024)


def gpt2_backbone_12():
    """A keras_hub GPT2Backbone of 12 transformer layers, width 256: planned without building GPT-2 medium for real."""
    import keras_hub

    return keras_hub.models.GPT2Backbone(vocabulary_size=4000, num_layers=12, num_heads=4, hidden_dim=256,
                                         intermediate_dim=1024, max_sequence_length=512)


def gpt2_backbone_small():
    """A small keras_hub GPT2Backbone."""
    import keras_hub

    return keras_hub.models.GPT2Backbone(vocabulary_size=4000, num_layers=4, num_heads=4, hidden_dim=256,
                                         intermediate_dim=1024, max_sequence_length=256)


def gpt2_backbone_tiny():
    """The warm-up model of ``measure_keras.py``: one transformer layer, width 16."""
    import keras_hub

    return keras_hub.models.GPT2Backbone(vocabulary_size=100, num_layers=1, num_heads=2, hidden_dim=16,
                                         intermediate_dim=32, max_sequence_length=256)
