"""Training frameworks: the Hugging Face ``Trainer`` (:mod:`.hf_trainer`, needs the
``hf`` extra), TRL's teacher client (:mod:`.trl_client`), and data-parallel helpers
(:mod:`.distributed`). Nothing here is imported until asked for."""
