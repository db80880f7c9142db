"""lmq as a model backend of LMQL: the plugin's model class (`plugin.py`), the import hook that lets the model
string alone switch a script to lmq (`hook.py`), the model process (`process.py`), LMQL's calls served by the
engine (`calls.py`) and LMQL's tokenizer for lmq models (`tokenizer.py`). Importing this package loads nothing."""
