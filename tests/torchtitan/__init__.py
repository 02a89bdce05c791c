"""torchtitan's own model code (Llama 3, Qwen3 dense/MoE, DeepSeek-V3) as test fixtures.

The folders config/, protocols/, models/ and ops/ hold files copied from
pytorch/torchtitan (BSD-3-Clause, see LICENSE here); each says at its top what
was changed. _stubs.py, configs.py and smoke.py are fxshard's own.
"""
