"""Integrations with training frameworks, each behind an optional extra pinned to the version tested.

- ``ckptguard.integrations.lightning``: ``CkptguardCheckpointIO``, ``CkptguardModelParallelStrategy`` (lightning 2.6.6)
- ``ckptguard.integrations.hf``: ``CkptguardTrainer`` (transformers 5.18.0)
- ``ckptguard.integrations.accelerate``: ``CkptguardAccelerator``, ``save_state``, ``load_state`` (accelerate 1.15.0)
- ``ckptguard.integrations.deepspeed``: ``install(engine)``, ``CkptguardCheckpointEngine`` (deepspeed 0.19.8)
- ``ckptguard.integrations.torchtitan``: ``CkptguardCheckpointManager`` (torchtitan 0.3.0)

Importing a module here imports its framework; ``ckptguard`` itself never does. Imported without its
framework, each raises one ``ImportError`` naming the line that installs it
(``pip install 'ckptguard[<extra>]'``, see ``_extra.py``; from a clone: ``pip install -e '.[<extra>]'``).
"""
