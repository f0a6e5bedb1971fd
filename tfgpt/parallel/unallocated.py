"""A model whose variables have shapes but no memory until a rank asks for its part.

A pipeline rank runs a few of a model's blocks. It builds the whole model
as every rank does, so that each variable has its path, its shape and its
initializer, but inside Keras's stateless scope, which records an
initializer instead of running it; the rank then allocates the variables
of its stage alone (`allocate`). Keras layers draw their initializers'
seeds when they are constructed, not when their variables are built, so a
variable allocated late gets the value it would have had in a one-process
run, bit for bit, in any order (tested in `tests/test_pipeline.py`).
"""

from keras.src.backend.common import global_state
from keras.src.backend.common.stateless_scope import StatelessScope


def build_unallocated(build_model):
    """`build_model()` with every variable left unallocated (shapes, no values)."""
    with StatelessScope(initialize_variables=False):
        model = build_model()
    # Keras keeps a list of the variables to allocate at the next stateless
    # scope's end; this model's are allocated by `allocate` or never.
    global_state.set_global_attribute("uninitialized_variables", [])
    return model


def allocated(variable):
    """Whether `variable` holds a value (a model built by `build_unallocated`
    holds only those of the variables `allocate` was given)."""
    return getattr(variable, "_initializer", None) is None


def allocate(variables):
    """Gives each unallocated variable of `variables` its initial value."""
    for variable in variables:
        if not allocated(variable):
            variable._deferred_initialize()
