"""Shared fixtures."""
import pytest
import torch


@pytest.fixture(scope='session', params=['llama3', 'qwen3', 'deepseek'])
def tokenizer_name(request):
    return request.param


@pytest.fixture(scope='session')
def llama3():
    return 'llama3'


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
