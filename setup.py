"""Packaging for maxtext_posttrain, a post-training plugin for MaxText.

MaxText 0.2.5 declares no base dependencies (everything sits in extras such as `tpu` and `cuda12`), so
`install_requires` lists what MaxText's CPU code paths and this package import. Reproducible environments come
from the pinned closure instead:

  make .venv/.installed        # or, by hand:
  pip install --no-deps -r requirements/cpu.txt && pip install --no-deps -e .

On a TPU VM: `pip install -e .[tpu]` (MaxText's own TPU extra, which brings libtpu and friends).
"""

import setuptools

MAXTEXT = "maxtext==0.2.5"

# Floors are the versions MaxText 0.2.5's extras ask for; requirements/cpu.txt pins the tested set.
INSTALL_REQUIRES = [
    MAXTEXT,
    "jax>=0.11.1",
    "jaxlib>=0.11.1",
    "flax>=0.12.9",
    "optax>=0.2.8",
    "orbax-checkpoint>=0.12.4",
    "grain>=0.2.18",
    "pydantic>=2.13.5",
    "omegaconf>=2.3.1",
    "absl-py>=2.5.0",
    "numpy>=2.1.3",
    "pyyaml>=6.0.3",
    "etils>=1.14.0",
    "jinja2>=3.1.6",
    "ml-collections>=1.1.0",
    "pathwaysutils>=0.1.11",
    "aqtp>=0.9.0",
    "qwix>=0.1.8",
    "tokamax>=0.0.14",
    "drjax>=0.2.1",
    "huggingface-hub>=1.32.0",
    "transformers>=5.17.0",
    "sympy>=1.12",
    "tiktoken>=0.14.0",
    "sentencepiece>=0.2.2",
    "tensorboardx>=2.6.5",
    "pillow>=12.3.0",
    "tensorflow-datasets>=4.9.10",
    "array-record>=0.8.3",
    "matplotlib>=3.11.1",
    "math-verify>=0.9.0",
]

EXTRAS_REQUIRE = {
    "tpu": ["maxtext[tpu]==0.2.5"],
    "test": ["pytest>=9.1.1", "pytest-xdist>=3.8.0", "pyink>=26.5.1"],
    # safety_eval and pii_redact (maxtext_posttrain.safety.pii); tldextract >= 5.4 reads the variable that keeps it
    # offline (TLDEXTRACT_PUBLIC_SUFFIX_LIST_URLS)
    # presidio-analyzer as requirements/cpu.txt pins it: later releases ask numpy < 2.5, below MaxText's closure.
    "safety": ["presidio-analyzer==2.2.362", "presidio-anonymizer>=2.2.362", "tldextract>=5.4.0"],
}

setuptools.setup(
    name="maxtext_posttrain",
    version="0.1.0",
    description="Post-training (SFT, preference tuning, RL, distillation) as a MaxText plugin.",
    python_requires=">=3.12",
    packages=setuptools.find_packages(include=["maxtext_posttrain", "maxtext_posttrain.*"]),
    package_data={"maxtext_posttrain": ["assets/*.model", "assets/safety/*", "configs/*.yml"]},
    include_package_data=True,
    install_requires=INSTALL_REQUIRES,
    extras_require=EXTRAS_REQUIRE,
)
