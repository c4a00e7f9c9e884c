"""The training template's commands, one module each, each a function of a composed Hydra config that
``scripts/<name>.py`` runs through :func:`moekit.cli.run_script` (and tests call with a composed config):

* :func:`~moekit.commands.train.train` - fit, then test the best checkpoint; writes the run record;
* :func:`~moekit.commands.evaluate.evaluate` - test a checkpoint;
* :func:`~moekit.commands.export.export` - a checkpoint's network as safetensors that timm loads, or (``format=hf``)
  a language model as a transformers folder;
* :func:`~moekit.commands.predict.predict` - top-5 classes of images from a checkpoint;
* :func:`~moekit.commands.quantize.quantize` - a checkpoint's experts quantized (GPTQ or round-to-nearest);
* :func:`~moekit.commands.probe.linear_probe` - the few-shot linear probe of a checkpoint's network;
* :func:`~moekit.commands.sample.sample` - text from a language-model checkpoint;
* :func:`~moekit.commands.plot_slots.plot_slots` - Soft MoE slot pictures of a checkpoint;
* :func:`~moekit.commands.tune_capacity.tune_capacity_demo` - train with the capacity tuner, draw its history.
"""
