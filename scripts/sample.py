"""Generate text from a language-model checkpoint:
``python scripts/sample.py ckpt_path=<ckpt> 'prompt="def "' [max_new_tokens=200] [temperature=0.8] [top_p=0.95]``."""

from pathlib import Path

from moekit.cli import run_script

if __name__ == "__main__":
    run_script("moekit.commands.sample:sample", "sample", Path(__file__).parents[1] / "configs")
