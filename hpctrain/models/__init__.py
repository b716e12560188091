"""Model families behind one small interface the trainer uses (``model.kind`` picks one).

  mlp.py   a multi-layer perceptron classifier on the tabular format
"""
