"""Only what pyproject.toml cannot say: the package list. The recipes stay in the
repository's top-level recipes/ folder and ship inside the package as
trainlib/recipes/ (mapped in pyproject.toml), where `--recipe NAME` finds them."""
from setuptools import find_packages, setup

setup(packages=find_packages(include=["trainlib*"]) + ["trainlib.recipes"])
