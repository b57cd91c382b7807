"""``python -m confkv.lmeval`` / ``confkv-lm-eval``: lm_eval's command line with the ``confkv`` model registered.

Example (SmolLM2, TOVA at 25% of the full KV bytes, INT8 store, a task folder of your own)::

    confkv-lm-eval --model confkv --model_args model=smollm2,policy=tova,memory=0.25,int8=True \\
        --include_path my_tasks/ --tasks my_task --batch_size 4
"""

from __future__ import annotations


def main() -> None:
    import confkv.lmeval  # noqa: F401  (registers the model "confkv")
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()


if __name__ == "__main__":
    main()
