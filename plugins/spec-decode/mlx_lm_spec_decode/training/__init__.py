"""``mlx-lm-ext train-drafter``: train an assistant drafter by self-distillation.

The target model is frozen. For each batch of real text it runs once, with
plain KV caches, giving what the drafter sees at inference time: its final
hidden states, its donor layers' K/V and its next-token distributions. The
drafter (``assistant.net.Assistant.unrolled``) then drafts ``--draft-steps``
chained tokens from every position at once, each step reading exactly the
donor keys a real draft from that position would read, and learns

- the target's next-token distribution (soft cross-entropy against the
  target's own softmax, i.e. KL up to a constant), and
- the target's final hidden state (smooth L1), which later steps take as
  their input in place of the target's.

Top-1 agreement (drafter argmax equals target argmax) is what greedy
acceptance measures; the progress bar shows it for the first step. The
figure on training batches is in-sample; the last ``--eval-rows`` rows of
the text and of the generated chats are held out and evaluated at every
checkpoint (``eval.jsonl``): held-out agreement on chat answers is what
decoding open-ended answers accepts (prompt tokens, e.g. the system prompt
repeated in every chat, are never drafted: chat rows train and count only
where the next token belongs to an answer). The decode loop computes exactly
the training graph's numbers (``test_loop_drafts_are_the_training_graph``).

Why not the flash-cce loss: distillation needs the target's full
distribution, so the ``[N, V]`` target logits exist anyway, and
``linear_cross_entropy`` computes hard-label cross-entropy only; on the GPU
the stock loss was also measured faster. The logits are bounded by
``--batch-size x --seq-len``.

``--generate N`` adds the target's own greedy answers to N chat prompts made
from the data (explain/summarize/continue a passage, short open questions on
its words), so the drafter also learns the target's chat register.

Output folder: ``assistant.json`` + ``assistant.safetensors`` (the drafter,
usable with ``--drafter assistant --drafter-path OUT`` at every checkpoint),
``data.safetensors`` (the tokenized training data, reused on resume),
``checkpoint/`` (float32 weights, optimizer state, step), ``log.jsonl``
(every step) and ``eval.jsonl`` (held-out agreement at every checkpoint).
Running the same command again resumes from the last checkpoint.

Modules, in the order a run uses them: ``cli`` (flags, checks),
``train`` (the run, step by step), ``data`` (text, rows, batches),
``chat`` (chat prompts and the target's answers), ``distill`` (the frozen
target, the loss, the training step), ``checkpoint`` (the output folder).
"""


class TrainError(RuntimeError):
    """Bad input to train-drafter: the message says what to do."""
