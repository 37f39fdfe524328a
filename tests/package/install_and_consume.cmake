# cmake -DKVT_SOURCE_DIR=... -DKVT_BUILD_DIR=... -DCONSUMER_SOURCE_DIR=... -DWORK_DIR=...
#       -DGENERATOR=... -DCXX_COMPILER=... [-DCXX_COMPILER_LAUNCHER=...] [-DTOOLS=a,b,...]
#       -P install_and_consume.cmake
#
# Installs the kvt build KVT_BUILD_DIR into WORK_DIR/stage, moves it to WORK_DIR/prefix, checks
# what the package holds, then configures, builds and runs CONSUMER_SOURCE_DIR against it with
# find_package(kvt) and CMAKE_PREFIX_PATH=WORK_DIR/prefix alone. WORK_DIR is removed on success.
cmake_minimum_required(VERSION 3.25)

foreach(var KVT_SOURCE_DIR KVT_BUILD_DIR CONSUMER_SOURCE_DIR WORK_DIR GENERATOR CXX_COMPILER)
  if(NOT ${var})
    message(FATAL_ERROR "install_and_consume.cmake: -D${var}=... is required")
  endif()
endforeach()

function(run what)
  message(STATUS "package test: ${what}: ${ARGN}")
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "package test: ${what} failed (${rc}): ${ARGN}")
  endif()
endfunction()

set(stage ${WORK_DIR}/stage)
set(prefix ${WORK_DIR}/prefix)
set(consumer_build ${WORK_DIR}/consumer-build)
file(REMOVE_RECURSE ${WORK_DIR})

run("install" ${CMAKE_COMMAND} --install ${KVT_BUILD_DIR} --prefix ${stage})
# A relocatable package works from wherever its prefix is moved to.
file(RENAME ${stage} ${prefix})

# What the package holds: the config files, the public headers, the wire contract, the tools,
# and nothing private.
file(GLOB_RECURSE config_files ${prefix}/*/kvtConfig.cmake)
file(GLOB_RECURSE version_files ${prefix}/*/kvtConfigVersion.cmake)
if(NOT config_files OR NOT version_files)
  message(FATAL_ERROR "package test: no kvtConfig.cmake / kvtConfigVersion.cmake under ${prefix}")
endif()
foreach(header kvt/transfer/engine.h kvt/transfer/registry.h kvt/pool/kv_pool.h
    kvt/common/status.h)
  if(NOT EXISTS ${prefix}/include/${header})
    message(FATAL_ERROR "package test: the public header ${header} is not installed")
  endif()
endforeach()
if(NOT EXISTS ${prefix}/share/kvt/proto/kvt/v1/agent.proto)
  message(FATAL_ERROR "package test: the wire contract is not installed in share/kvt/proto")
endif()
string(REPLACE "," ";" tools "${TOOLS}")
foreach(tool ${tools})
  if(NOT EXISTS ${prefix}/bin/${tool})
    message(FATAL_ERROR "package test: the tool ${tool} is not installed in ${prefix}/bin")
  endif()
endforeach()
if("kvt-bootstrap" IN_LIST tools)
  run("run an installed tool" ${prefix}/bin/kvt-bootstrap --help)
endif()
file(GLOB_RECURSE generated RELATIVE ${prefix} ${prefix}/*.pb.h)
file(GLOB_RECURSE private_headers RELATIVE ${prefix} ${prefix}/include/control/*
  ${prefix}/include/engine/*)
if(generated OR private_headers)
  message(FATAL_ERROR "package test: private or generated headers are installed: "
                      "${generated} ${private_headers}")
endif()
# Nothing in the package's CMake files points back into the source or build tree (or the stage).
file(GLOB_RECURSE cmake_files ${prefix}/*.cmake)
foreach(file ${cmake_files})
  file(READ ${file} text)
  foreach(tree ${KVT_SOURCE_DIR} ${KVT_BUILD_DIR} ${stage})
    string(FIND "${text}" "${tree}" at)
    if(NOT at EQUAL -1)
      message(FATAL_ERROR "package test: ${file} names ${tree}: the package is not relocatable")
    endif()
  endforeach()
endforeach()

set(launcher)
if(CXX_COMPILER_LAUNCHER)
  set(launcher -DCMAKE_CXX_COMPILER_LAUNCHER=${CXX_COMPILER_LAUNCHER})
endif()
run("configure the consumer" ${CMAKE_COMMAND} -S ${CONSUMER_SOURCE_DIR} -B ${consumer_build}
  -G ${GENERATOR} -DCMAKE_BUILD_TYPE=Release -DCMAKE_CXX_COMPILER=${CXX_COMPILER} ${launcher}
  -DCMAKE_PREFIX_PATH=${prefix} -DCMAKE_FIND_USE_PACKAGE_REGISTRY=OFF)
# The kvt it found is the installed one.
file(STRINGS ${consumer_build}/CMakeCache.txt kvt_dir REGEX "^kvt_DIR:")
string(REGEX REPLACE "^kvt_DIR:[A-Z]+=" "" kvt_dir "${kvt_dir}")
cmake_path(IS_PREFIX prefix "${kvt_dir}" NORMALIZE found_installed)
if(NOT found_installed)
  message(FATAL_ERROR "package test: find_package(kvt) found '${kvt_dir}', not the package in "
                      "${prefix}")
endif()
run("build the consumer" ${CMAKE_COMMAND} --build ${consumer_build})
run("run the consumer" ${consumer_build}/kvt_consumer)

file(REMOVE_RECURSE ${WORK_DIR})
