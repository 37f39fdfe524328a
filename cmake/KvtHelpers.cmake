# kvt_library(<name> SOURCES ... DEPS ...): a library kvt_<name> (static, or shared with
# BUILD_SHARED_LIBS=ON), alias kvt::<name>, public headers in <dir>/include.
function(kvt_library name)
  cmake_parse_arguments(ARG "" "" "SOURCES;PUBLIC_DEPS;PRIVATE_DEPS" ${ARGN})
  add_library(kvt_${name} ${ARG_SOURCES})
  add_library(kvt::${name} ALIAS kvt_${name})
  set_target_properties(kvt_${name} PROPERTIES EXPORT_NAME ${name})
  target_include_directories(kvt_${name}
    PUBLIC $<BUILD_INTERFACE:${CMAKE_CURRENT_SOURCE_DIR}/include> $<INSTALL_INTERFACE:include>
    PRIVATE ${CMAKE_CURRENT_SOURCE_DIR}/src)
  target_link_libraries(kvt_${name} PUBLIC ${ARG_PUBLIC_DEPS} PRIVATE ${ARG_PRIVATE_DEPS})
  # The public headers are C++20: users of the installed targets get the standard with them.
  target_compile_features(kvt_${name} PUBLIC cxx_std_20)
  kvt_warnings(kvt_${name})
  set_property(GLOBAL APPEND PROPERTY KVT_EXPORTED_TARGETS kvt_${name})
endfunction()

function(kvt_warnings target)
  target_compile_options(${target} PRIVATE
    $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra -Wno-unused-parameter>
    $<$<COMPILE_LANGUAGE:CUDA>:-Xcompiler=-Wall --expt-relaxed-constexpr>)
  if(KVT_WERROR)
    target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:-Werror>)
  endif()
endfunction()

# kvt_test(<name> SOURCES ... DEPS ... [LABELS ...]): a GoogleTest executable registered with
# ctest through gtest_discover_tests.
function(kvt_test name)
  cmake_parse_arguments(ARG "" "TIMEOUT" "SOURCES;DEPS;LABELS" ${ARGN})
  add_executable(${name} ${ARG_SOURCES})
  target_link_libraries(${name} PRIVATE ${ARG_DEPS} GTest::gtest GTest::gtest_main GTest::gmock)
  kvt_warnings(${name})
  if(NOT ARG_TIMEOUT)
    set(ARG_TIMEOUT 120)
  endif()
  set(props TIMEOUT ${ARG_TIMEOUT})
  if(ARG_LABELS)
    list(APPEND props LABELS "${ARG_LABELS}")
  endif()
  gtest_discover_tests(${name} DISCOVERY_TIMEOUT 60 PROPERTIES ${props})
  # The target kvt_host_tests builds every suite that needs no GPU and no root (what
  # tools/ci/sanitize.sh runs).
  if(NOT "gpu" IN_LIST ARG_LABELS AND NOT "multinode" IN_LIST ARG_LABELS)
    set_property(GLOBAL APPEND PROPERTY KVT_HOST_TEST_TARGETS ${name})
  endif()
endfunction()
