"""The one exception the converter raises for bad input: its message is a single line that
names the file and the problem, and the CLI prints it without a traceback."""


class ConversionError(Exception):
    pass
