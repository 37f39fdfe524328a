# cmake -DKVT_SOURCE_DIR=... -DKVT_BUILD_DIR=... -DCONSUMER_SOURCE_DIR=... -DWORK_DIR=...
#       -DGENERATOR=... -DCXX_COMPILER=... [-DCXX_COMPILER_LAUNCHER=...] [-DTOOLS=a,b,...]
#       [-DHOW=find_package|pkg-config] [-DPKG_CONFIG=...] [-DLIBDIR=lib]
#       [-DPROGRAM=kvt_consumer] [-DPROGRAM_ARGS=a,b,...] [-DSHARED=ON|OFF]
#       -P install_and_consume.cmake
#
# Installs the kvt build KVT_BUILD_DIR into WORK_DIR/stage, moves it to WORK_DIR/prefix, checks
# what the package holds (the libraries of the kind SHARED says, the tools, each run from there
# with --help), then builds CONSUMER_SOURCE_DIR against it and runs PROGRAM with PROGRAM_ARGS:
#   HOW=find_package  configure the project with find_package(kvt) and
#                     CMAKE_PREFIX_PATH=WORK_DIR/prefix alone, build it, run its PROGRAM;
#   HOW=pkg-config    compile CONSUMER_SOURCE_DIR/main.cc with
#                     `pkg-config --cflags --libs [--static] kvt` and PKG_CONFIG_PATH naming only
#                     the prefix's LIBDIR/pkgconfig (--static unless SHARED).
# WORK_DIR is removed on success.
cmake_minimum_required(VERSION 3.25)

foreach(var KVT_SOURCE_DIR KVT_BUILD_DIR CONSUMER_SOURCE_DIR WORK_DIR GENERATOR CXX_COMPILER)
  if(NOT ${var})
    message(FATAL_ERROR "install_and_consume.cmake: -D${var}=... is required")
  endif()
endforeach()

if(NOT HOW)
  set(HOW find_package)
endif()
if(NOT HOW MATCHES "^(find_package|pkg-config)$")
  message(FATAL_ERROR "install_and_consume.cmake: HOW='${HOW}' is neither find_package nor "
                      "pkg-config")
endif()
if(HOW STREQUAL "pkg-config" AND NOT PKG_CONFIG)
  message(FATAL_ERROR "install_and_consume.cmake: HOW=pkg-config needs -DPKG_CONFIG=<pkg-config>")
endif()
if(NOT PROGRAM)
  set(PROGRAM kvt_consumer)
endif()
if(NOT LIBDIR)
  set(LIBDIR lib)
endif()
string(REPLACE "," ";" program_args "${PROGRAM_ARGS}")

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
foreach(header kvt/transfer/engine.h kvt/transfer/layout.h kvt/transfer/registry.h
    kvt/pool/kv_pool.h kvt/common/status.h)
  if(NOT EXISTS ${prefix}/include/${header})
    message(FATAL_ERROR "package test: the public header ${header} is not installed")
  endif()
endforeach()
if(NOT EXISTS ${prefix}/${LIBDIR}/pkgconfig/kvt.pc)
  message(FATAL_ERROR "package test: kvt.pc is not installed in ${prefix}/${LIBDIR}/pkgconfig")
endif()
# The libraries, of the kind this build makes.
if(SHARED)
  set(kind "shared")
  set(suffix .so)
  set(other .a)
else()
  set(kind "static")
  set(suffix .a)
  set(other .so)
endif()
foreach(lib kvt_common kvt_kernels kvt_pool kvt_proto kvt_transfer_core kvt_transfer)
  if(NOT EXISTS ${prefix}/${LIBDIR}/lib${lib}${suffix})
    message(FATAL_ERROR "package test: the ${kind} library lib${lib}${suffix} is not installed in "
                        "${prefix}/${LIBDIR}")
  endif()
endforeach()
file(GLOB wrong_kind ${prefix}/${LIBDIR}/libkvt_*${other})
if(wrong_kind)
  message(FATAL_ERROR "package test: a ${kind} build installed ${wrong_kind}")
endif()
if(NOT EXISTS ${prefix}/share/kvt/proto/kvt/v1/agent.proto)
  message(FATAL_ERROR "package test: the wire contract is not installed in share/kvt/proto")
endif()
string(REPLACE "," ";" tools "${TOOLS}")
foreach(tool ${tools})
  if(NOT EXISTS ${prefix}/bin/${tool})
    message(FATAL_ERROR "package test: the tool ${tool} is not installed in ${prefix}/bin")
  endif()
endforeach()
# Every tool runs from the moved prefix (a shared build's find their libraries through their
# RPATH, relative to bin/, not through the build tree or LD_LIBRARY_PATH).
unset(ENV{LD_LIBRARY_PATH})
foreach(tool ${tools})
  execute_process(COMMAND ${prefix}/bin/${tool} --help RESULT_VARIABLE rc OUTPUT_VARIABLE out
    ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "package test: the installed ${tool} --help failed (${rc}):\n${out}${err}")
  endif()
endforeach()
file(GLOB_RECURSE generated RELATIVE ${prefix} ${prefix}/*.pb.h)
file(GLOB_RECURSE private_headers RELATIVE ${prefix} ${prefix}/include/control/*
  ${prefix}/include/engine/* ${prefix}/include/kvt/common/log.h
  ${prefix}/include/kvt/common/log_level.h)
if(generated OR private_headers)
  message(FATAL_ERROR "package test: private or generated headers are installed: "
                      "${generated} ${private_headers}")
endif()
# Nothing in the package's CMake and pkg-config files points back into the source or build tree
# (or the stage).
file(GLOB_RECURSE cmake_files ${prefix}/*.cmake ${prefix}/*.pc)
foreach(file ${cmake_files})
  file(READ ${file} text)
  foreach(tree ${KVT_SOURCE_DIR} ${KVT_BUILD_DIR} ${stage})
    string(FIND "${text}" "${tree}" at)
    if(NOT at EQUAL -1)
      message(FATAL_ERROR "package test: ${file} names ${tree}: the package is not relocatable")
    endif()
  endforeach()
endforeach()

if(HOW STREQUAL "pkg-config")
  # As a Makefile user would: the compiler, C++20 and what pkg-config says, nothing else.
  set(ENV{PKG_CONFIG_PATH} ${prefix}/${LIBDIR}/pkgconfig)
  unset(ENV{PKG_CONFIG_LIBDIR})
  set(static --static)
  if(SHARED)
    set(static)
  endif()
  execute_process(COMMAND ${PKG_CONFIG} --cflags --libs ${static} kvt RESULT_VARIABLE rc
    OUTPUT_VARIABLE flags ERROR_VARIABLE err OUTPUT_STRIP_TRAILING_WHITESPACE)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "package test: pkg-config --cflags --libs ${static} kvt failed (${rc}): ${err}")
  endif()
  execute_process(COMMAND ${PKG_CONFIG} --variable=libdir kvt OUTPUT_VARIABLE libdir
    OUTPUT_STRIP_TRAILING_WHITESPACE)
  file(REAL_PATH "${libdir}" libdir)
  file(REAL_PATH "${prefix}/${LIBDIR}" expected_libdir)
  if(NOT libdir STREQUAL expected_libdir)
    message(FATAL_ERROR "package test: kvt.pc's libdir is '${libdir}', not the moved prefix's "
                        "${expected_libdir}: the .pc file is not relocatable")
  endif()
  message(STATUS "package test: pkg-config --cflags --libs ${static} kvt: ${flags}")
  separate_arguments(flags UNIX_COMMAND "${flags}")
  set(rpath)
  if(SHARED)
    set(rpath -Wl,-rpath,${libdir})
  endif()
  file(MAKE_DIRECTORY ${consumer_build})
  run("compile and link the consumer with pkg-config" ${CXX_COMPILER} -std=c++20 -O1
    ${CONSUMER_SOURCE_DIR}/main.cc -o ${consumer_build}/${PROGRAM} ${flags} ${rpath})
else()
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
endif()
if(SHARED)
  # The program loads kvt's shared libraries from the prefix, not from the build tree.
  execute_process(COMMAND ldd ${consumer_build}/${PROGRAM} OUTPUT_VARIABLE loaded)
  string(REGEX MATCHALL "libkvt_[a-z_]+\\.so[^\n]*" kvt_loaded "${loaded}")
  if(NOT kvt_loaded)
    message(FATAL_ERROR "package test: ${PROGRAM} loads no libkvt_*.so of a shared build:\n${loaded}")
  endif()
  foreach(line ${kvt_loaded})
    string(FIND "${line}" "${prefix}/" at)
    if(at EQUAL -1)
      message(FATAL_ERROR "package test: ${PROGRAM} loads ${line}, not from ${prefix}")
    endif()
  endforeach()
endif()
run("run ${PROGRAM}" ${consumer_build}/${PROGRAM} ${program_args})

file(REMOVE_RECURSE ${WORK_DIR})
