"""Package metadata for tfgpt.

Dependencies come from requirements.txt so there is one list to keep current.
Horovod is not among them: scripts/build_horovod.sh builds it from source
against the installed TensorFlow (see scripts/setup.sh).
"""

from pathlib import Path

from setuptools import find_packages, setup


def read_requirements(path):
    """Return the requirement lines of `path`, without comments and blanks."""
    requirements = []
    for line in Path(path).read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            requirements.append(line)
    return requirements


HERE = Path(__file__).parent

setup(
    name="tfgpt",
    version="0.1.0",
    description="Keras 3 / TensorFlow 2 model zoo (GPT, BERT/ALBERT) "
    "trained with Horovod or tf.distribute.",
    packages=find_packages(
        include=["tfgpt", "tfgpt.*", "pipelines", "pipelines.*"]
    ),
    python_requires=">=3.11",
    install_requires=read_requirements(HERE / "requirements.txt"),
    # `tfgpt SUBCOMMAND`: tfgpt/__main__.py.
    entry_points={"console_scripts": ["tfgpt = tfgpt.__main__:main"]},
)
