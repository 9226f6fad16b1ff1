"""Keras 3 models for the planner's tests, mirroring torch_models: an MLP, a CNN, a small Transformer."""
import keras
from keras import layers


def mlp(width: int = 512, depth: int = 4, features: int = 256, classes: int = 10) -> keras.Model:
    stack = [keras.Input((features,))] + [layers.Dense(width, activation="relu") for _ in range(depth)]
    return keras.Sequential(stack + [layers.Dense(classes)])


def cnn(channels: int = 128, blocks: int = 4, classes: int = 10) -> keras.Model:
    """For 32 x 32 x 3 images (channels last): a strided stem, then equal conv blocks, as torch_models.cnn."""
    stack = [keras.Input((32, 32, 3)), layers.Conv2D(channels, 3, strides=2, padding="same"), layers.BatchNormalization(),
             layers.ReLU()]
    for block in range(blocks):
        stack.append(layers.Conv2D(channels, 3, padding="same", activation="relu"))
        if block % 2:
            stack.append(layers.MaxPooling2D(2))
    return keras.Sequential(stack + [layers.GlobalAveragePooling2D(), layers.Dense(classes)])


class EncoderBlock(layers.Layer):
    """Post-norm Transformer encoder block, as torch.nn.TransformerEncoderLayer."""

    def __init__(self, width: int, heads: int, dropout: float = 0.1, **kwargs):
        super().__init__(**kwargs)
        self.attention = layers.MultiHeadAttention(heads, width // heads, dropout=dropout)
        self.norm1, self.norm2 = layers.LayerNormalization(), layers.LayerNormalization()
        self.up, self.down = layers.Dense(4 * width, activation="relu"), layers.Dense(width)
        self.drop1, self.drop2 = layers.Dropout(dropout), layers.Dropout(dropout)

    def call(self, x, training=None):
        x = self.norm1(x + self.drop1(self.attention(x, x, training=training), training=training))
        return self.norm2(x + self.drop2(self.down(self.up(x)), training=training))


def transformer(vocab: int = 1000, tokens: int = 64, width: int = 128, heads: int = 4, blocks: int = 2,
                classes: int = 10) -> keras.Model:
    """For int32 token ids of shape (tokens,)."""
    stack = [keras.Input((tokens,), dtype="int32"), layers.Embedding(vocab, width)]
    stack += [EncoderBlock(width, heads) for _ in range(blocks)]
    return keras.Sequential(stack + [layers.GlobalAveragePooling1D(), layers.Dense(classes)])


def resnet50() -> keras.Model:
    """keras.applications.ResNet50 without weights (no download), for 224 x 224 x 3 images: a graph of 176 layers."""
    return keras.applications.ResNet50(weights=None, input_shape=(224, 224, 3))
