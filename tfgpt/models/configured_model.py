"""A Keras model whose architecture is one config dataclass."""

import dataclasses
import inspect

import keras

from tfgpt.models.layer_tree import LayerTree


class ConfiguredModel(LayerTree, keras.Model):
    """Base of the models built from a config dataclass (`config_class`).

    The constructor takes the config's fields as keyword arguments, plus
    Keras's own (`name`, `dtype`, `trainable`). It builds
    `self.config = config_class(**fields)`, which checks every field and
    fills in the defaults, before anything else; each field is then a
    read-only attribute of the model (`model.hidden_dim`), and
    `get_config()` is Keras's plus the config's fields. So constructor
    arguments, config fields and `get_config()` keys are one list, written
    once in the dataclass: `cls(**dataclasses.asdict(config))`,
    `cls.from_config(model.get_config())` and `.keras` files all go through
    the same constructor.

    A subclass sets `config_class` and builds its layers in `__init__` after
    `super().__init__(**kwargs)`.
    """

    config_class = None

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "config_class" not in cls.__dict__:
            return
        fields = dataclasses.fields(cls.config_class)
        for field in fields:
            setattr(cls, field.name, property(_config_field(field.name)))
        # What `help()` and `inspect.signature` show for `cls(...)`.
        keyword = inspect.Parameter.KEYWORD_ONLY
        cls.__signature__ = inspect.Signature(
            [inspect.Parameter(field.name, keyword, default=field.default) for field in fields]
            + [inspect.Parameter("kwargs", inspect.Parameter.VAR_KEYWORD)]
        )

    def __init__(self, **kwargs):
        names = {field.name for field in dataclasses.fields(self.config_class)}
        config = self.config_class(**{name: kwargs.pop(name) for name in names & set(kwargs)})
        super().__init__(**kwargs)
        self.config = config

    @classmethod
    def from_preset(cls, name, **overrides):
        """Builds the named preset of the config's family, `overrides` applied on top."""
        return cls(**dataclasses.asdict(cls.config_class.from_preset(name, **overrides)))

    def get_config(self):
        return super().get_config() | dataclasses.asdict(self.config)


def _config_field(name):
    def read(self):
        return getattr(self.config, name)

    read.__doc__ = f"The config's `{name}`."
    return read
