# Writes the text of IN as a C++ raw string constant kBridgeSource into OUT.
file(READ "${IN}" _text)
string(FIND "${_text}" ")LLMDDPY\"" _clash)
if(NOT _clash EQUAL -1)
  message(FATAL_ERROR "${IN} contains the raw-string delimiter")
endif()
file(WRITE "${OUT}" "// generated from ${IN}; do not edit\n#pragma once\nstatic const char kBridgeSource[] = R\"LLMDDPY(${_text})LLMDDPY\";\n")
