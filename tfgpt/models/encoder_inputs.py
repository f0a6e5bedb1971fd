"""The inputs every encoder (BERT, ALBERT) and its task models accept."""

ENCODER_INPUT_KEYS = ("token_ids", "segment_ids", "padding_mask")


def unpack_encoder_inputs(inputs, extra_keys=()):
    """Returns `(token_ids, segment_ids, padding_mask, extras)` from model inputs.

    Encoders take a dict, so that a tf.data element maps onto them
    unchanged, or a bare token id tensor:

    - `token_ids`: int (B, T). Required.
    - `segment_ids`: int (B, T), 0 for the first sentence and 1 for the
      second. Default: all 0.
    - `padding_mask`: bool/int (B, T), true at real tokens. Default: all real.

    Args:
        inputs: dict or int tensor.
        extra_keys: tuple of str. Further keys the caller accepts (for
            example `mask_positions`); returned in `extras`, None if absent.

    Raises:
        ValueError: `token_ids` is missing or a key is not recognised (a
            misspelt `input_ids` would otherwise be silently ignored).
    """
    if not isinstance(inputs, dict):
        return inputs, None, None, {key: None for key in extra_keys}
    allowed = ENCODER_INPUT_KEYS + tuple(extra_keys)
    unknown = sorted(set(inputs) - set(allowed))
    if unknown or "token_ids" not in inputs:
        raise ValueError(
            f"Encoder inputs must be a dict with `token_ids` and optionally "
            f"{', '.join(f'`{key}`' for key in allowed[1:])}. "
            f"Received keys: {sorted(inputs)}"
        )
    extras = {key: inputs.get(key) for key in extra_keys}
    return inputs["token_ids"], inputs.get("segment_ids"), inputs.get("padding_mask"), extras



def pack_encoder_inputs(token_ids, segment_ids=None, padding_mask=None):
    """The inverse of `unpack_encoder_inputs`: a dict without the absent keys."""
    inputs = {"token_ids": token_ids}
    if segment_ids is not None:
        inputs["segment_ids"] = segment_ids
    if padding_mask is not None:
        inputs["padding_mask"] = padding_mask
    return inputs
