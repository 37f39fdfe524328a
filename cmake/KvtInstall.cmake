# The installed package: libraries, public headers, and a CMake package that find_package(kvt)
# finds (kvtConfig.cmake, kvtConfigVersion.cmake, kvtTargets*.cmake), relocatable with its
# prefix. Installed: kvt::common, kvt::kernels, kvt::pool, kvt::transfer and the static
# libraries kvt::transfer links (kvt::transfer_core, the backends, kvt::proto); never
# kvt::transfer_internal, its private headers, generated protobuf headers or anything of tests/.
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

get_property(kvt_targets GLOBAL PROPERTY KVT_EXPORTED_TARGETS)
foreach(target ${kvt_targets})
  get_target_property(dir ${target} SOURCE_DIR)
  cmake_path(IS_PREFIX PROJECT_SOURCE_DIR "${dir}" NORMALIZE inside)
  file(RELATIVE_PATH rel ${PROJECT_SOURCE_DIR} ${dir})
  if(NOT inside OR rel MATCHES "^(tests|tools)(/|$)")
    message(FATAL_ERROR "${target} (from ${dir}) is marked for installation, but only the "
                        "libraries of common/, kernels/, pool/, proto/ and transfer/ are installed; "
                        "define test and tool libraries with add_library, not kvt_library")
  endif()
endforeach()

install(TARGETS ${kvt_targets} EXPORT kvtTargets
  ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR} LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR})
foreach(component common kernels pool transfer)
  if(EXISTS ${CMAKE_CURRENT_SOURCE_DIR}/${component}/include)
    install(DIRECTORY ${component}/include/ DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
  endif()
endforeach()

set(KVT_CMAKE_INSTALL_DIR ${CMAKE_INSTALL_LIBDIR}/cmake/kvt)
install(EXPORT kvtTargets NAMESPACE kvt:: DESTINATION ${KVT_CMAKE_INSTALL_DIR})
configure_package_config_file(cmake/kvtConfig.cmake.in
  ${PROJECT_BINARY_DIR}/cmake/kvtConfig.cmake
  INSTALL_DESTINATION ${KVT_CMAKE_INSTALL_DIR})
# 0.x: a new minor version may break the API, so only the same major.minor is compatible.
write_basic_package_version_file(${PROJECT_BINARY_DIR}/cmake/kvtConfigVersion.cmake
  VERSION ${PROJECT_VERSION} COMPATIBILITY SameMinorVersion)
install(FILES ${PROJECT_BINARY_DIR}/cmake/kvtConfig.cmake
              ${PROJECT_BINARY_DIR}/cmake/kvtConfigVersion.cmake
  DESTINATION ${KVT_CMAKE_INSTALL_DIR})
