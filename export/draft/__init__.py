"""Making a draft head (export/draft_head.py holds its file): the model's own sequences and the last layer's outputs
its export computes on them (`data`), its chains for every position at once (`chain`), its training and the
acceptance it reaches at each depth (`training`)."""
