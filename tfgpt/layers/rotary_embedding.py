"""Rotary position embeddings: queries and keys turned by angles that grow with position."""

import math

import tensorflow as tf


def inverse_frequencies(rotary_dim, theta=10000.0, scaling="none", factor=1.0,
                        low_frequency_factor=1.0, high_frequency_factor=4.0,
                        original_max_length=8192):
    """The (rotary_dim / 2,) float32 angular frequencies of a rotary embedding.

    Pair i turns by `position * theta ** (-2i / rotary_dim)` (Su et al.
    2021), stretched as `scaling` says: `linear` divides every frequency
    by `factor`; `llama3` divides the low ones (wavelength above
    `original_max_length / low_frequency_factor`) by it, keeps the high
    ones (wavelength below `original_max_length / high_frequency_factor`)
    and blends the ones between (Llama 3.1's `rope_type` llama3). The
    arguments are `GPTConfig`'s `rope_*` fields.
    """
    exponents = tf.range(0, rotary_dim, 2, dtype=tf.float32) / rotary_dim
    frequencies = 1.0 / tf.pow(tf.constant(theta, tf.float32), exponents)
    if scaling == "linear":
        return frequencies / factor
    if scaling == "llama3":
        low_wavelength = original_max_length / low_frequency_factor
        high_wavelength = original_max_length / high_frequency_factor
        wavelengths = 2 * math.pi / frequencies
        scaled = tf.where(wavelengths > low_wavelength, frequencies / factor, frequencies)
        smooth = (original_max_length / wavelengths - low_frequency_factor) / (
            high_frequency_factor - low_frequency_factor)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        between = tf.logical_and(wavelengths >= high_wavelength, wavelengths <= low_wavelength)
        return tf.where(between, blended, scaled)
    return frequencies


def rotate(x, positions, frequencies, interleaved=False):
    """`x` (B, H, T, D) with its first `2 * len(frequencies)` features turned.

    Args:
        x: float tensor (B, H, T, D): queries or keys.
        positions: int tensor (B, T) or (1, T): each token's position.
        frequencies: float32 (R / 2,) from `inverse_frequencies`.
        interleaved: bool. Turn features (0, 1), (2, 3), ... (GPT-J);
            otherwise feature i with feature i + R / 2 (GPT-NeoX, Llama).

    The angles and the turn run in float32; the result has `x`'s dtype.
    The features past R pass through.
    """
    rotary_dim = 2 * frequencies.shape[0]
    angles = tf.cast(positions, tf.float32)[:, tf.newaxis, :, tf.newaxis]  # (B, 1, T, 1)
    angles = angles * frequencies  # (B, 1, T, R/2)
    cos, sin = tf.cos(angles), tf.sin(angles)  # (B, 1, T, R/2)
    turned, passed = x[..., :rotary_dim], x[..., rotary_dim:]
    turned = tf.cast(turned, tf.float32)
    if interleaved:
        even, odd = turned[..., 0::2], turned[..., 1::2]  # (B, H, T, R/2) each
        pairs = tf.stack([even * cos - odd * sin, odd * cos + even * sin], axis=-1)  # (..., R/2, 2)
        turned = tf.reshape(pairs, tf.shape(turned))  # (B, H, T, R)
    else:
        first, second = tf.split(turned, 2, axis=-1)  # (B, H, T, R/2) each
        turned = tf.concat([first * cos - second * sin, second * cos + first * sin], axis=-1)
    turned = tf.cast(turned, x.dtype)
    if x.shape[-1] == rotary_dim:
        return turned
    return tf.concat([turned, passed], axis=-1)  # (B, H, T, D)
