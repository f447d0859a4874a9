"""What a request and an answer are: ``ScoreBatch`` (one batch to score),
``TeacherPayload`` (the answer as ``[B, S, K]`` tensors), the alignment of answers to
padded batches, and the decoding of wire answers into payloads. Imports no client."""
