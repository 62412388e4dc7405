"""Where the inputs of a model call the studio makes itself go: the one rule, `on_model_device`.
Imports torch when used: child processes only.

The rule, per call and backend:

- A forward (`model(input_ids=...)`: Generator.score, the evaluation's losses): the inputs on
  the model's own device, on every backend. Nothing on the way moves them: a model loaded on one
  device (`device_map="neuron"`, `{"": 0}`) gets no Accelerate hooks (Transformers'
  modeling_utils dispatches with hooks only for a map of more than one device, or disk), and
  its forward uses them where they are, so a CPU tensor meets the device's weights and the op
  fails ("Expected all tensors to be on the same device").
- generate(): on Neuron, the inputs stay on CPU. Transformers moves what each forward consumes
  onto the model's device right before the call (GenerationMixin.prepare_inputs_for_generation,
  step 6, in transformers/generation/utils.py, "so the generation loop's growing-tensor
  bookkeeping stays off-device"), and the output ids and attention mask, which grow by a token
  each step, stay on CPU where no new shape reaches the device (on Neuron a new shape is a
  compilation). On CUDA and CPU they go to the model's device, as usual there.

The device is read from the model's parameters, so a LoRA run's PEFT wrapper (whose parameters
are its base model's and the adapter's) answers the same as the model under it.

The other calls the studio makes are placed by their library: lm-eval's HFLM, given a loaded
model, takes `model.device` as its device and moves each batch there (lm_eval/models/huggingface.py,
`HFLM.__init__` and `_loglikelihood_tokens`; studio_core.evaluate.harness); the training workers and the
precompile jobs run TRL's trainers, whose Trainer._prepare_inputs moves each batch to
`args.device` (transformers/trainer.py). The reward functions are plain Python on texts: they
call no model.
"""

from __future__ import annotations

# Device types whose generate() inputs stay on CPU (see the module's doc).
GENERATE_ON_CPU = frozenset({"neuron"})


def model_device(model):
    """The device of the model's parameters (CPU for a model that has none)."""
    import torch

    first = next(iter(model.parameters()), None)
    return first.device if first is not None else torch.device("cpu")


def on_model_device(model, *, generate: bool = False, **tensors) -> dict:
    """`tensors` placed for a call to `model`: a forward's (the default) on the model's device;
    generate()'s on CPU where the model is on Neuron, else on its device. Returns them as a dict,
    to pass as keywords: `model(**on_model_device(model, input_ids=ids))`."""
    import torch

    device = model_device(model)
    if generate and device.type in GENERATE_ON_CPU:
        device = torch.device("cpu")
    return {name: tensor.to(device) for name, tensor in tensors.items()}
