"""FX helpers the patterns and the pass share: graph walks, the canonical spellings both the
real graph and the pattern traces are put in, module paths from ``nn_module_stack``, and the
node chains a miss's explanation shows. They know nothing of families or the pipeline."""
